"""Zeroing an embedding's padding row where that row actually lives.

``weight[padding_idx]`` on a vocab-sharded DTensor all-gathers the whole embedding into a
replicated copy, and zeroing that copy leaves the real weight untouched (no error). Here each rank
finds, from its own placement, whether its local shard holds global row ``padding_idx`` and zeroes
its local slice of it in place: under ``Shard(0)`` only the owning rank writes, under ``Shard(1)``
every rank zeroes its columns of the row, under ``Replicate`` every rank zeroes its copy. No
collective is involved.
"""

from __future__ import annotations

import torch

from nemo_wrap.errors import InvalidPaddingIndexError
from nemo_wrap.initialization.geometry import local_shard, shard_geometry


def zero_padding_row_(weight: torch.Tensor, padding_idx: int, *, name: str = "weight") -> torch.Tensor:
    """Zero global row ``padding_idx`` of the 2-D ``weight`` (plain tensor or DTensor), in place.

    Negative indices count from the end, as in ``nn.Embedding``. Meta tensors are left alone.
    Raises :class:`InvalidPaddingIndexError` if ``weight`` is not 2-D or the index is out of range.
    """
    if weight.dim() != 2:
        raise InvalidPaddingIndexError(f"{name}: expected a 2-D embedding weight, got shape {tuple(weight.shape)}")
    rows = weight.shape[0]
    if not -rows <= padding_idx < rows:
        raise InvalidPaddingIndexError(f"padding_idx={padding_idx} is outside the {rows} rows of {name}")
    row = padding_idx % rows
    geometry = shard_geometry(weight, name)
    local = local_shard(weight)
    if local.is_meta:
        return weight
    positions, _ = geometry.positions_in(0, row, row + 1)
    local.index_fill_(0, positions.to(local.device), 0)
    return weight
