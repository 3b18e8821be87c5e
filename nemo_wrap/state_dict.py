"""The state-dict protocol: how a model's tensors correspond to a transformers checkpoint's keys.

Both directions of checkpoint I/O need the same three facts — which tensors a model has to fill
(distinct tensors, ties resolved), which windows of which checkpoint tensors make up one of its
tensors (:class:`SourceBlock`), and how a whole state dict converts to transformers' keys. They
live here, below the models that implement adapters and the loader and writer that use them, so
neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, NamedTuple, Protocol

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


class EncodedWeight(nn.Module):
    """A layer that holds its checkpoint tensor ``weight`` encoded (e.g. quantized to 4 bits).

    The tensors of the encoding (:attr:`encoding`, the layer's own names) are parameters — sharded,
    gathered and saved for resuming like any other — but no checkpoint holds them: a checkpoint
    holds ``weight``, ``[out_features, in_features]``, which the layer decodes to ``weight_dtype``.
    So :func:`checkpoint_tensors` leaves them out, :func:`encoded_weights` names such layers by the
    tensor they stand for, and reading, verifying and writing that tensor go through the layer.
    """

    encoding: ClassVar[tuple[str, ...]] = ()
    in_features: int
    out_features: int
    weight_dtype: torch.dtype

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def describe(self) -> str:
        """How the checkpoint tensor is held (for the load report)."""
        raise NotImplementedError

    def local_rows(self) -> torch.Tensor:
        """The global indices of the rows of ``weight`` this rank holds; its columns are all held."""
        raise NotImplementedError

    def start_encoding(self) -> None:
        """Called on every rank before this rank's rows are encoded (even when it holds none)."""
        raise NotImplementedError

    def encode_rows(self, values: torch.Tensor, first: int) -> None:
        """Encode ``values``, local rows ``first, first + 1, …`` of ``weight``, into this rank's storage."""
        raise NotImplementedError

    def finish_encoding(self) -> None:
        """After every rank encoded its rows; collective when the layer is sharded (every rank calls
        it for every layer, in the same order)."""
        raise NotImplementedError

    def encode(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The encoding of the whole ``weight`` by the layer's own tensor names, made in one piece
        (independent of any sharding): what verifying compares with the layer's tensors."""
        raise NotImplementedError

    def decoded(self) -> torch.Tensor:
        """The whole ``weight`` in ``weight_dtype`` (collective when the layer is sharded)."""
        raise NotImplementedError


def encoded_weights(model: nn.Module) -> dict[str, EncodedWeight]:
    """Every :class:`EncodedWeight` layer of ``model`` by the name of the tensor it holds (``….weight``)."""
    return {
        f"{name}.weight" if name else "weight": module
        for name, module in model.named_modules()
        if isinstance(module, EncodedWeight)
    }


def checkpoint_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Distinct tensors to fill or write (parameters + persistent buffers), and tie target → source.

    A tied parameter is one object under two names; the first name is the one a checkpoint holds
    (transformers' checkpoints omit the tie target). The encoding tensors of an
    :class:`EncodedWeight` are left out: they stand for a checkpoint tensor (see
    :func:`encoded_weights`) rather than being one.
    """
    distinct: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_name: dict[int, str] = {}
    encodings = {
        f"{prefix}.{tensor}" if prefix else tensor
        for prefix, layer in model.named_modules()
        if isinstance(layer, EncodedWeight)
        for tensor in layer.encoding
    }
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if name in encodings:
            continue
        if id(tensor) in first_name:
            tied[name] = first_name[id(tensor)]
        else:
            first_name[id(tensor)] = name
            distinct[name] = tensor
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            full_name = f"{module_name}.{buffer_name}" if module_name else buffer_name
            persistent = buffer_name not in module._non_persistent_buffers_set
            if buffer is not None and persistent and full_name not in encodings:
                distinct[full_name] = buffer
    return distinct, tied
