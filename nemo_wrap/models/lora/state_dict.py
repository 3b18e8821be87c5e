"""How a LoRA model's tensors split between the base checkpoint and the PEFT adapter file."""

from __future__ import annotations

from collections.abc import Mapping

import torch

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
