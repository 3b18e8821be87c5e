"""Random initialization that does not depend on how a tensor is sharded.

Why tiles: a generator's output depends on the size of each draw (on CPU, ``normal_`` of 8
values is not the first 8 values of ``normal_`` of 64 with the same state), and DTensor random ops
on a CPU mesh give every rank the same local values. So a rank cannot draw "its part" of one
stream. Instead, each parameter's *global* shape is cut into a fixed grid of tiles (blocks of
whole rows along dimension 0, about ``_TILE_NUMEL`` elements each, one row at least); every tile
is drawn whole, in float32, from its own ``torch.Generator`` seeded by a stable hash of
``(seed, parameter name, tile index)``, and each rank keeps only the intersection of the tile with
its shard. The grid depends only on the global shape, so any sharding — or none — assembles the
same full tensor, with no collective and, beyond the shard, working memory of a few tile-sized
buffers (the tile, its slice, the cast).

The tile size and the hash are part of what the values *are*: changing either changes every
initialization produced with a given seed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers.initialization import TORCH_INIT_FUNCTIONS

from nemo_wrap.initialization.geometry import ShardGeometry, local_shard, shard_geometry

# 2**16 float32 values: 256 KiB of working memory per tile.
_TILE_NUMEL = 1 << 16


class Distribution(Protocol):
    """Fills a float32 tile in place, drawing only from ``generator``."""

    def sample_(self, tile: torch.Tensor, generator: torch.Generator) -> None: ...


@dataclass(frozen=True)
class Normal:
    """Gaussian ``N(mean, std**2)``, as ``torch.nn.init.normal_``."""

    mean: float = 0.0
    std: float = 1.0

    def sample_(self, tile: torch.Tensor, generator: torch.Generator) -> None:
        tile.normal_(self.mean, self.std, generator=generator)


@dataclass(frozen=True)
class Uniform:
    """Uniform on ``[low, high)``, as ``torch.nn.init.uniform_``."""

    low: float = 0.0
    high: float = 1.0

    def sample_(self, tile: torch.Tensor, generator: torch.Generator) -> None:
        tile.uniform_(self.low, self.high, generator=generator)


@dataclass(frozen=True)
class TruncatedNormal:
    """Gaussian truncated to ``[low, high]``, as ``torch.nn.init.trunc_normal_`` (absolute bounds)."""

    mean: float = 0.0
    std: float = 1.0
    low: float = -2.0
    high: float = 2.0

    def sample_(self, tile: torch.Tensor, generator: torch.Generator) -> None:
        # transformers keeps torch's original primitives here, untouched by any patching.
        trunc_normal_ = cast("Callable[..., torch.Tensor]", TORCH_INIT_FUNCTIONS["trunc_normal_"])
        trunc_normal_(tile, mean=self.mean, std=self.std, a=self.low, b=self.high, generator=generator)


def _tile_generator(seed: int, name: str, tile: int) -> torch.Generator:
    """A generator whose state is a pure function of (seed, name, tile), stable across processes.

    Python's ``hash`` is salted per process, hence SHA-256.
    """
    digest = hashlib.sha256(f"{seed}\x00{name}\x00{tile}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def random_fill_(tensor: torch.Tensor, distribution: Distribution, *, seed: int, name: str) -> torch.Tensor:
    """Fill ``tensor`` (plain or DTensor) in place with the seeded, sharding-independent draw.

    ``name`` is the parameter's fully qualified name; with ``seed`` and the global shape it
    determines every value. Draws happen on the CPU in float32 (an accelerator's generator would
    give other numbers) and are cast to the tensor's dtype and device. Meta tensors and empty
    shards are left alone. Returns ``tensor``.
    """
    geometry = shard_geometry(tensor, name)
    local = local_shard(tensor)
    if local.is_meta or geometry.is_empty:
        return tensor
    if not geometry.global_shape:  # a 0-d tensor is one tile of one row
        geometry, local = ShardGeometry((1,), (torch.zeros(1, dtype=torch.long),)), local.view(1)
    shape, dim_indices = geometry.global_shape, geometry.dim_indices
    row_shape = shape[1:]
    rows_per_tile = max(1, _TILE_NUMEL // max(1, math.prod(row_shape)))
    for tile in torch.unique(dim_indices[0] // rows_per_tile).tolist():
        start = tile * rows_per_tile
        stop = min(start + rows_per_tile, shape[0])
        block = torch.empty((stop - start, *row_shape), dtype=torch.float32)
        distribution.sample_(block, _tile_generator(seed, name, tile))
        positions, rows = geometry.positions_in(0, start, stop)
        part = block.index_select(0, rows - start)
        for dim in range(1, len(shape)):
            if dim_indices[dim].numel() != shape[dim]:  # a sharded dimension: keep my columns
                part = part.index_select(dim, dim_indices[dim])
        local.index_copy_(0, positions.to(local.device), part.to(local.device, local.dtype))
    return tensor
