"""How a LoRA model's tensors split between the base checkpoint and the PEFT adapter file."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nemo_wrap.models.lora.layers import LoraAdapters
from nemo_wrap.models.lora.targets import is_lora_parameter, peft_key
from nemo_wrap.state_dict import SourceBlock, StateDictAdapter, whole


class BaseWeightsAdapter:
    """The base checkpoint's view: the base adapter for every tensor but the LoRA ones, which the
    base checkpoint never holds."""

    def __init__(self, base: StateDictAdapter) -> None:
        self.base = base

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        return [] if is_lora_parameter(key) else self.base.blocks(key, shape)

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return (peft_key(key),) if is_lora_parameter(key) else self.base.expected_keys(key)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.base.to_hf({k: v for k, v in state_dict.items() if not is_lora_parameter(k)})


class AdapterFileAdapter:
    """The PEFT adapter file's view: each LoRA tensor whole under PEFT's key, nothing else."""

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        return [SourceBlock(peft_key(key), whole(shape), whole(shape))] if is_lora_parameter(key) else []

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return (peft_key(key),) if is_lora_parameter(key) else ()

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {peft_key(k): v for k, v in state_dict.items() if is_lora_parameter(k)}


class MergedWeightsAdapter:
    """The base view with each adapted weight merged: ``W[rows] += scaling · (B @ A)[pair rows]``.

    Used while saving, one gathered weight at a time, so a merged checkpoint never needs the whole
    model twice; ``adapters`` are the full (gathered) LoRA tensors by our parameter names.
    """

    def __init__(self, base: StateDictAdapter, model: nn.Module, adapters: Mapping[str, torch.Tensor]) -> None:
        self.base = base
        self.model = model
        self.adapters = adapters

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        return [] if is_lora_parameter(key) else self.base.blocks(key, shape)

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return self.base.expected_keys(key)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        merged = {k: self._merged(k, v) for k, v in state_dict.items() if not is_lora_parameter(k)}
        return self.base.to_hf(merged)

    def _merged(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        layer, _, tensor_name = key.rpartition(".")
        parent, _, leaf = layer.rpartition(".")
        name = f"{parent}.lora_{leaf}" if parent else f"lora_{leaf}"
        adapters = _submodule(self.model, name) if tensor_name == "weight" else None
        if not isinstance(adapters, LoraAdapters):
            return weight
        merged = weight.to(torch.float32)  # a copy: the gathered tensor may be the parameter itself
        merged = merged.clone() if merged is weight else merged
        for part, placement in adapters.placements.items():
            a, b = (self.adapters[f"{name}.pairs.{part}.lora_{x}"].to(torch.float32) for x in "AB")
            product = (b @ a) * adapters.scalings[part]
            for pair_rows, layer_rows in placement:
                merged[layer_rows] += product[pair_rows]
        return merged.to(weight.dtype)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
