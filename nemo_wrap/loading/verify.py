"""``verify=True``: prove, after loading, that the ranks together hold exactly the checkpoint.

Per tensor, a checksum of bit patterns keyed by global element index: the sum over elements of
``bits(x[i]) * weight(i)`` modulo the prime 2**31 - 1. It is exact integer arithmetic, so it does not
depend on summation order, on how the tensor is sharded, or on which rank holds what — a value in
the wrong place changes it. The expected side re-reads the checkpoint (the one allowed second
read), each tensor on one rank in turn; the actual side sums the local shards of the ranks that own
a distinct piece (replicas along ``Replicate`` mesh dims count once). Plain tensors, replicated by
DDP, are compared on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader
from nemo_wrap.distributed.collectives import RankGroup, collective_device
from nemo_wrap.errors import LoadVerificationError, summarize
from nemo_wrap.initialization.geometry import ShardGeometry, local_shard, shard_geometry
from nemo_wrap.loading.provenance import Loaded, Provenance
from nemo_wrap.loading.read import CopyBlock, checkpoint_copier, fill_from_blocks
from nemo_wrap.state_dict import StateDictAdapter

_PRIME = 2**31 - 1
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(values: torch.Tensor, geometry: ShardGeometry) -> int:
    """Σ bits(values[i]) · weight(global index of i)  mod 2**31 - 1, for a local block."""
    if values.numel() == 0:
        return 0
    bits = values.detach().contiguous().view(_BITS[values.element_size()]).to(torch.int64)
    bits = torch.remainder(bits, _PRIME).reshape(-1)
    shape = geometry.global_shape
    flat = torch.zeros(geometry.local_shape, dtype=torch.int64)
    for dim, index in enumerate(geometry.dim_indices):
        stride = math.prod(shape[dim + 1 :])
        flat = flat + index.view([-1 if d == dim else 1 for d in range(len(shape))]) * stride
    weights = torch.remainder(flat.reshape(-1) * 40503 + 7919, _PRIME)
    return int(torch.remainder(torch.remainder(bits * weights, _PRIME).sum(), _PRIME))


def _owns_distinct_piece(tensor: DTensor) -> bool:
    """Whether this rank's shard is counted: one copy of every distinct piece, across all ranks.

    Copies come from ``Replicate`` dims of the tensor's mesh, and from meshes that are sub-meshes of
    the world: under FSDP over tensor parallel, norms live on the ``dp`` sub-mesh, and every ``tp``
    position holds the same shards on a parallel sub-mesh. Of those parallel sub-meshes, exactly one
    holds global rank 0; it is the one counted.
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    return (
        coordinate is not None
        and bool((mesh.mesh == 0).any())
        and all(coordinate[d] == 0 for d, p in enumerate(tensor.placements) if isinstance(p, Replicate))
    )


def _expected_full(name: str, like: torch.Tensor, adapter: StateDictAdapter, copy_block: CopyBlock) -> torch.Tensor:
    """The full tensor the checkpoint holds for ``name``, assembled as the loader would (one process)."""
    full = torch.empty(tuple(like.shape), dtype=like.dtype)
    fill_from_blocks(full, shard_geometry(full, name), adapter.blocks(name, tuple(like.shape)), copy_block)
    return full


def verify_load(
    tensors: dict[str, torch.Tensor],
    provenance: dict[str, Provenance],
    adapter: StateDictAdapter,
    checkpoint: Checkpoint,
    group: RankGroup,
) -> None:
    """Raise :class:`LoadVerificationError` (on every rank) naming each tensor that differs."""
    names = [name for name in tensors if isinstance(provenance.get(name), Loaded)]
    distributed = group.collective
    device = collective_device()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    expected = torch.zeros(len(names), dtype=torch.int64)
    actual = torch.zeros(len(names), dtype=torch.int64)
    with BlockReader() as reader, torch.no_grad():
        copy_block = checkpoint_copier(checkpoint, reader)
        for i, name in enumerate(names):
            tensor = tensors[name]
            if i % world == rank:
                full = _expected_full(name, tensor, adapter, copy_block)
                expected[i] = _checksum(full, shard_geometry(full, name))
            if not isinstance(tensor, DTensor) or _owns_distinct_piece(tensor):
                actual[i] = _checksum(local_shard(tensor), shard_geometry(tensor, name))
    is_dtensor = torch.tensor([isinstance(tensors[n], DTensor) for n in names], dtype=torch.bool)
    if distributed:
        both = torch.stack([expected, torch.where(is_dtensor, actual, torch.zeros_like(actual))]).to(device)
        dist.all_reduce(both)
        expected, reduced = both[0].cpu() % _PRIME, both[1].cpu() % _PRIME
        actual = torch.where(is_dtensor, reduced, actual)
    wrong = (expected != actual).to(torch.int64)
    if distributed:  # every rank raises, naming every tensor wrong anywhere
        wrong = wrong.to(device)
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
        wrong = wrong.cpu()
    bad = [names[i] for i in torch.nonzero(wrong).flatten().tolist()]
    if bad:
        raise LoadVerificationError(
            f"{checkpoint.directory}: {len(bad)} tensor(s) differ from the checkpoint after loading: {summarize(bad)}"
        )
