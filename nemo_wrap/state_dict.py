"""The state-dict protocol: how a model's tensors correspond to a transformers checkpoint's keys.

Both directions of checkpoint I/O need the same three facts — which tensors a model has to fill
(distinct tensors, ties resolved), how one of its tensors maps to checkpoint keys and rows, and
how a whole state dict converts to transformers' keys. They live here, below the models that
implement adapters and the loader and writer that use them, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch
from torch import nn


class HFSource(NamedTuple):
    """Rows ``hf_rows`` of checkpoint tensor ``hf_key`` fill rows ``local_rows`` of a requested range.

    ``local_rows`` counts from the start of the range (row ``row_start`` of the model's tensor is
    local row 0) and may be strided (step 2 for an interleaved fused weight), so
    ``buffer[local_rows] = hf[hf_rows]``.
    """

    hf_key: str
    hf_rows: slice
    local_rows: slice


class StateDictAdapter(Protocol):
    """Converts between a model's parameter names and transformers' checkpoint keys."""

    def hf_sources(self, key: str, row_start: int, row_stop: int) -> list[HFSource]:
        """Which checkpoint rows fill rows ``[row_start, row_stop)`` of the model's tensor ``key``."""
        ...

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's (full) tensors under transformers' keys."""
        ...


class IdentityAdapter:
    """transformers' own classes: parameter names are checkpoint keys, rows map one to one."""

    def hf_sources(self, key: str, row_start: int, row_stop: int) -> list[HFSource]:
        if row_start == row_stop:
            return []
        return [HFSource(key, slice(row_start, row_stop), slice(0, row_stop - row_start))]

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(state_dict)


def checkpoint_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Distinct tensors to fill or write (parameters + persistent buffers), and tie target → source.

    A tied parameter is one object under two names; the first name is the one a checkpoint holds
    (transformers' checkpoints omit the tie target).
    """
    distinct: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
        else:
            first_name[id(tensor)] = name
            distinct[name] = tensor
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                distinct[f"{module_name}.{buffer_name}" if module_name else buffer_name] = buffer
    return distinct, tied
