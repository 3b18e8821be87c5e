"""The forward hook that adds a layer's adapters to its output (plain LoRA, or DoRA)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.models.lora.dora import dora_output
from nemo_wrap.models.lora.layers import LoraAdapters


def add_lora_output(adapters: LoraAdapters, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
    """Forward hook of an adapted linear layer (bound to its ``adapters``): its output plus theirs,
    computed in the adapters' dtype (float32 beside a 4-bit layer, as PEFT does) and added in the
    output's. One dropout mask serves the adapters and, with DoRA, its base term (as in PEFT)."""
    if not adapters.enabled:
        return output
    x = args[0]
    dropped = adapters.dropout(x)
    if isinstance(output, DTensor) and isinstance(dropped, DTensor):
        delta: torch.Tensor = adapters.sharded(dropped, output)
    else:
        delta = adapters(dropped.to(adapters.dtype)).to(output.dtype)
    if adapters.uses_dora:
        return dora_output(adapters, module, None if dropped is x else dropped, output, delta)
    return output + delta
