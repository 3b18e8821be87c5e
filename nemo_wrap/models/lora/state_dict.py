"""How a LoRA model's tensors split between the base checkpoint and the PEFT adapter file."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nemo_wrap.models.lora.dora import merged_weight
from nemo_wrap.models.lora.layers import LoraAdapters, adapters_name, row_index
from nemo_wrap.models.lora.modules_to_save import modules_to_save_keys
from nemo_wrap.models.lora.settings import LoraSettings
from nemo_wrap.models.lora.targets import is_lora_parameter, peft_key
from nemo_wrap.state_dict import SourceBlock, StateDictAdapter, checkpoint_tensors, whole


class BaseWeightsAdapter:
    """The base checkpoint's view: the base adapter for every tensor but the LoRA ones, which the
    base checkpoint never holds. ``untied`` (target → source: ties that ``modules_to_save`` undid)
    reads each target from its source's tensor, which is all a tied checkpoint holds of it."""

    def __init__(self, base: StateDictAdapter, untied: Mapping[str, str] | None = None) -> None:
        self.base = base
        self.untied = dict(untied or {})

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        return [] if is_lora_parameter(key) else self.base.blocks(self.untied.get(key, key), shape)

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return (peft_key(key),) if is_lora_parameter(key) else self.base.expected_keys(self.untied.get(key, key))

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.base.to_hf({k: v for k, v in state_dict.items() if not is_lora_parameter(k)})


def adapter_file_keys(model: nn.Module, settings: LoraSettings, base: StateDictAdapter) -> dict[str, str]:
    """Every tensor a PEFT adapter file holds for ``model``, our name → PEFT's key: the LoRA pairs'
    tensors, and the parameters of the modules to save (``modules_to_save``)."""
    distinct, _ = checkpoint_tensors(model)
    keys = {name: peft_key(name) for name in distinct if is_lora_parameter(name)}
    return {**keys, **modules_to_save_keys(model, settings, base)}


class AdapterFileAdapter:
    """The PEFT adapter file's view: each tensor it holds (``keys``: our name → PEFT's key) whole
    under its key, nothing else."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self.keys = dict(keys)

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        return [SourceBlock(self.keys[key], whole(shape), whole(shape))] if key in self.keys else []

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return (self.keys[key],) if key in self.keys else ()

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.keys[k]: v for k, v in state_dict.items() if k in self.keys}


class MergedWeightsAdapter:
    """The base view with each adapted weight merged: ``W[rows] += scaling · (B @ A)[pair rows]``
    (with DoRA ``(m / ‖W + s·B·A‖) ⊙ (W + s·B·A)``), and each adapted bias ``b += scaling · lora_bias``.

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

    def _merged(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        layer, _, tensor_name = key.rpartition(".")
        name = adapters_name(layer)
        adapters = _submodule(self.model, name) if tensor_name in ("weight", "bias") else None
        if not isinstance(adapters, LoraAdapters) or tensor.is_meta:  # meta: the file's layout only
            return tensor
        merged = tensor.to(torch.float32)  # a copy: the gathered tensor may be the parameter itself
        merged = merged.clone() if merged is tensor else merged
        if tensor_name == "bias":
            for part, placement in adapters.placements.items():
                bias = self.adapters.get(f"{name}.pairs.{part}.lora_bias")
                if bias is not None:
                    merged[row_index(placement)] += bias.to(torch.float32) * adapters.scalings[part]
        elif adapters.uses_dora:
            merged_weight(adapters, merged, self.adapters, name)
        else:
            for part, placement in adapters.placements.items():
                a, b = (self.adapters[f"{name}.pairs.{part}.lora_{x}"].to(torch.float32) for x in "AB")
                merged[row_index(placement)] += (b @ a) * adapters.scalings[part]
        return merged.to(tensor.dtype)


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None
