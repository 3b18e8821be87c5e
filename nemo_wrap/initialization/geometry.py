"""Where a rank's local shard sits inside the full tensor.

Every shard-aware fill in this package writes "the full tensor's values at my positions" into the
local shard, so it needs, per tensor dimension, the global index of each local position. A start
offset and a length are not enough in general: FSDP2 over tensor parallelism lays parameters out
with ``_StridedShard``, whose local rows are the concatenation of pieces of several chunks when the
placements are applied in other orders. Keeping the full index list per dimension handles that and
costs only O(sum of dimension sizes), never O(numel).

The indices are derived by running each placement's own split (the one ``distribute_tensor`` and
FSDP2 use) on an index vector, mesh dimension by mesh dimension from left to right, exactly as
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` does; that function
returns only the first offset, which is why it is not called directly. ``Shard`` splits follow
``torch.chunk``: ceil-sized chunks, trailing ranks possibly empty (257 rows over 4 ranks:
65/65/65/62; 9 over 4: 3/3/3/0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from nemo_wrap.errors import UnsupportedPlacementError


@dataclass(frozen=True, eq=False)
class ShardGeometry:
    """The local shard of a tensor, described in global coordinates.

    ``dim_indices[d][i]`` is the global index, along dimension ``d``, of local position ``i``. The
    local shard is the Cartesian product of these index lists; a plain tensor's lists are the full
    ranges.
    """

    global_shape: tuple[int, ...]
    dim_indices: tuple[torch.Tensor, ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local shard (what ``to_local()`` returns)."""
        return tuple(int(index.numel()) for index in self.dim_indices)

    @property
    def global_offset(self) -> tuple[int, ...]:
        """Global index of the local shard's first element per dimension.

        Same convention as ``compute_local_shape_and_global_offset``: an empty dimension reports the
        global size of that dimension.
        """
        return tuple(
            int(index[0]) if index.numel() else size
            for index, size in zip(self.dim_indices, self.global_shape, strict=True)
        )

    @property
    def is_empty(self) -> bool:
        """Whether this rank holds no element (uneven sharding can leave trailing ranks empty)."""
        return any(index.numel() == 0 for index in self.dim_indices)

    def positions_in(self, dim: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local positions along ``dim`` whose global index lies in ``[start, stop)``.

        Returns ``(local_positions, global_indices)``, both 1-D int64 and aligned.
        """
        index = self.dim_indices[dim]
        positions = torch.nonzero((index >= start) & (index < stop)).flatten()
        return positions, index[positions]


def shard_geometry(tensor: torch.Tensor, name: str = "tensor") -> ShardGeometry:
    """Compute the local shard's global indices for a plain tensor or a DTensor.

    ``name`` only labels errors. Works on meta tensors too (it is shape arithmetic), though fills
    skip them. Raises :class:`UnsupportedPlacementError` for placements other than ``Replicate``,
    ``Shard`` and ``_StridedShard`` (a ``Partial`` tensor has no per-rank slice of the value).
    """
    global_shape = tuple(int(size) for size in tensor.shape)
    dim_indices = [torch.arange(size) for size in global_shape]
    if not isinstance(tensor, DTensor):
        return ShardGeometry(global_shape, tuple(dim_indices))
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is outside the tensor's mesh: it holds nothing
        return ShardGeometry(global_shape, tuple(torch.arange(0) for _ in global_shape))
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise UnsupportedPlacementError(
                f"{name}: placement {placement!r} on mesh dimension {mesh_dim} has no local slice "
                "of the full tensor to initialize"
            )
        dim = placement.dim
        # The placement splits along its own tensor dim: present the index vector with that shape.
        as_dim = dim_indices[dim].view([1] * dim + [-1])
        pieces, _ = placement._split_tensor(as_dim, mesh.size(mesh_dim), with_padding=False, contiguous=False)
        dim_indices[dim] = pieces[coordinate[mesh_dim]].reshape(-1)
    return ShardGeometry(global_shape, tuple(dim_indices))


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds this rank's values: ``to_local()`` of a DTensor, else itself.

    Writing into it in place changes the DTensor (no copy, no collective); call under
    ``torch.no_grad()`` when the tensor is a parameter.
    """
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return tensor
