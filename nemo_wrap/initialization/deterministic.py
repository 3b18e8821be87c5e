"""Shard-aware fills whose values need no generator: constants and copies of a full tensor.

They still go through :func:`shard_geometry` rather than writing the DTensor directly: an
indexed or sliced write on a sharded DTensor lands in a gathered copy (the padding-row defect),
and the placement check refuses ``Partial`` layouts, where writing a constant on every rank would
multiply it.
"""

from __future__ import annotations

import torch

from nemo_wrap.initialization.geometry import local_shard, shard_geometry


def constant_fill_(tensor: torch.Tensor, value: float, *, name: str = "tensor") -> torch.Tensor:
    """Set every element of ``tensor`` (plain or DTensor) to ``value``; meta tensors are skipped."""
    shard_geometry(tensor, name)  # refuses layouts without a per-rank slice
    local = local_shard(tensor)
    if not local.is_meta:
        local.fill_(value)
    return tensor


def copy_global_(tensor: torch.Tensor, source: torch.Tensor, *, name: str = "tensor") -> torch.Tensor:
    """Copy the full tensor ``source`` into ``tensor`` (plain or DTensor), each rank its own part.

    ``source`` is a plain tensor with (or broadcastable to) ``tensor``'s global shape, such as the
    rotary ``inv_freq`` a model recomputes from its config. Meta tensors are skipped.
    """
    geometry = shard_geometry(tensor, name)
    local = local_shard(tensor)
    if local.is_meta or geometry.is_empty:
        return tensor
    part = torch.as_tensor(source).expand(geometry.global_shape)
    for dim, index in enumerate(geometry.dim_indices):
        part = part.index_select(dim, index.to(part.device))
    local.copy_(part)
    return tensor
