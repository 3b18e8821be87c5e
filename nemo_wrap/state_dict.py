"""The state-dict protocol: how a model's tensors correspond to a transformers checkpoint's keys.

Both directions of checkpoint I/O need the same three facts — which tensors a model has to fill
(distinct tensors, ties resolved), which windows of which checkpoint tensors make up one of its
tensors (:class:`SourceBlock`), and how a whole state dict converts to transformers' keys. They
live here, below the models that implement adapters and the loader and writer that use them, so
neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import torch
from torch import nn


class SourceBlock(NamedTuple):
    """A window of a model tensor filled by a window of one checkpoint tensor.

    ``target`` has one slice per dimension of the model's tensor (a step is allowed: our fused
    gate/up rows interleave two checkpoint tensors); ``source`` has one slice per dimension of the
    checkpoint tensor, each of step 1 and of the same length as the matching target slice. When the
    checkpoint tensor has one dimension fewer, the model's tensor stacks such tensors along its
    dimension 0 (one expert per index, as transformers' merged MoE experts are), and the block's
    target slice on dimension 0 has length 1.
    """

    hf_key: str
    target: tuple[slice, ...]
    source: tuple[slice, ...]

    @property
    def stacked(self) -> bool:
        return len(self.source) == len(self.target) - 1


class StateDictAdapter(Protocol):
    """Converts between a model's parameter names and transformers' checkpoint keys."""

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        """The windows of checkpoint tensors that fill the model's tensor ``key`` of ``shape``.

        Together they cover the tensor exactly once; an empty list means the checkpoint has nothing
        for it.
        """
        ...

    def expected_keys(self, key: str) -> tuple[str, ...]:
        """The checkpoint keys (or key patterns) that would fill ``key``, for error messages."""
        ...

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's (full) tensors under transformers' keys and layout."""
        ...


def whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Every index of every dimension of ``shape``."""
    return tuple(slice(0, size) for size in shape)


class IdentityAdapter:
    """transformers' own classes without a conversion: parameter names are checkpoint keys."""

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        return [SourceBlock(key, whole(shape), whole(shape))]

    def expected_keys(self, key: str) -> tuple[str, ...]:
        return (key,)

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
