"""Whole tensors on the writer, one at a time, from every rank — and from every pipeline stage.

A consolidated save writes every tensor of the model once. Without pipeline parallel every rank
holds every name (sharded or not), so each tensor is gathered with ``full_tensor()`` in the same
order everywhere. A pipeline stage holds only its own names: the stages first exchange which names
(shape, dtype) they hold — so every rank knows the whole model's list and the same file plan — then
each tensor is gathered inside the first stage that holds it and sent by that stage's first rank to
the writer (global rank 0). A tied embedding held by the first and last stage is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.pipeline.runtime import PipelineRuntime
from nemo_wrap.state_dict import EncodedWeight


@dataclass(frozen=True)
class TensorInfo:
    """What the file plan needs of a tensor, known on every rank: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


# A tensor to write: a tensor (possibly a DTensor), or a layer that holds it encoded (4-bit).
Writable = torch.Tensor | EncodedWeight


def gather_full(tensor: Writable) -> torch.Tensor:
    """The whole tensor on the CPU (an encoded one decoded): every rank of a DTensor (of a sharded
    encoded layer) must call it, in the same order."""
    if isinstance(tensor, EncodedWeight):
        full = tensor.decoded()
    else:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().to("cpu").contiguous()


def _info(tensor: Writable) -> TensorInfo:
    if isinstance(tensor, EncodedWeight):
        return TensorInfo(tensor.weight_shape, tensor.weight_dtype)
    return TensorInfo(tuple(tensor.shape), tensor.dtype)


@dataclass(frozen=True)
class SavingRanks:
    """Who takes part in a consolidated save: the ranks that act together, and this rank's pipeline
    stage (``None``: the whole model is on this rank)."""

    group: RankGroup
    pipeline: PipelineRuntime | None = None


class FullTensors:
    """The model's tensors by name (the whole model's list on every rank), and :meth:`full`."""

    def __init__(self, local: Mapping[str, Writable], pipeline: PipelineRuntime | None) -> None:
        self.local = dict(local)
        self.pipeline = pipeline
        self.owner: dict[str, int] = {}  # name → the global rank that sends it to the writer
        if pipeline is None:
            self.info = {name: _info(t) for name, t in self.local.items()}
            return
        mine = [(name, _info(t).shape, _info(t).dtype) for name, t in self.local.items()]
        everyone: list[list] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, (pipeline.layout.index, mine))
        self.info = {}
        for stage, held in sorted(everyone, key=lambda entry: entry[0]):  # stage order: the model's order
            for name, shape, dtype in held:
                if name not in self.info:
                    self.info[name] = TensorInfo(shape, dtype)
                    self.owner[name] = pipeline.stage_ranks[stage][0]

    def full(self, name: str, is_writer: bool) -> torch.Tensor | None:
        """Tensor ``name`` whole on the writer (``None`` elsewhere). Every rank calls it for every
        name, in the same order."""
        if self.pipeline is None:
            return gather_full(self.local[name])
        sender = self.owner[name]
        if self.pipeline.stage_ranks[self.pipeline.layout.index][0] != sender:
            whole = None  # another stage's tensor
        else:
            whole = gather_full(self.local[name])  # collective inside the owning stage
        if sender == 0:
            return whole if is_writer else None
        rank = dist.get_rank()
        if rank == sender:
            assert whole is not None  # the sender is its stage's first rank: it gathered the tensor
            dist.send(whole, dst=0)
        elif is_writer:
            info = self.info[name]
            whole = torch.empty(info.shape, dtype=info.dtype)
            dist.recv(whole, src=sender)
            return whole
        return None
