"""``verify=True``: prove, after loading, that the ranks together hold exactly the checkpoint.

Per tensor, an exact checksum of bit patterns keyed by global position (:mod:`.checksum`): it does
not depend on summation order, on how the tensor is sharded, or on which rank holds what — a value
in the wrong place changes it. The expected side re-reads the checkpoint (the one allowed second
read), each tensor on one rank in turn, window by window straight from the mapped files as the
adapter names them, in global coordinates — not through the loader's shard geometry, which is
what it checks; the actual side sums the local shards of the ranks that own a distinct piece
(replicas along ``Replicate`` mesh dims count once). Plain tensors, replicated by DDP, are compared
on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader
from nemo_wrap.distributed.collectives import RankGroup, collective_device
from nemo_wrap.errors import LoadVerificationError, summarize
from nemo_wrap.initialization.geometry import local_shard, shard_geometry
from nemo_wrap.loading.checksum import PRIME, checksum
from nemo_wrap.loading.provenance import Loaded, Provenance
from nemo_wrap.loading.read import BlockView, checkpoint_blocks
from nemo_wrap.state_dict import StateDictAdapter


def _owns_distinct_piece(tensor: DTensor, first_rank: int) -> bool:
    """Whether this rank's shard is counted: one copy of every distinct piece, across the group.

    Copies come from ``Replicate`` dims of the tensor's mesh, and from meshes that are sub-meshes of
    the group: under FSDP over tensor parallel, norms live on the ``dp`` sub-mesh, and every ``tp``
    position holds the same shards on a parallel sub-mesh. Of those parallel sub-meshes, exactly one
    holds the group's first rank (``first_rank``, a job-wide rank); it is the one counted.
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    return (
        coordinate is not None
        and bool((mesh.mesh == first_rank).any())
        and all(coordinate[d] == 0 for d, p in enumerate(tensor.placements) if isinstance(p, Replicate))
    )


def _expected_checksum(name: str, like: torch.Tensor, adapter: StateDictAdapter, view_block: BlockView) -> int:
    """The checksum of the full tensor the checkpoint holds for ``name``, in ``like``'s dtype."""
    total = 0
    for block in adapter.blocks(name, tuple(like.shape)):
        with view_block(block.hf_key, block.source) as window:
            values = window if window.dtype == like.dtype else window.to(like.dtype)
            if block.stacked:  # the checkpoint tensor lacks the stacking dim 0
                values = values.unsqueeze(0)
            indices = [range(s.start, s.stop, s.step or 1) for s in block.target]
            total += checksum(values, indices, tuple(like.shape))
    return total % PRIME


def verify_load(
    tensors: dict[str, torch.Tensor],
    provenance: dict[str, Provenance],
    adapter: StateDictAdapter,
    checkpoint: Checkpoint,
    group: RankGroup,
) -> None:
    """Raise :class:`LoadVerificationError` (on every rank of ``group``) naming each tensor that differs.

    ``group`` holds the same tensor names on every rank (the job, or one pipeline stage's ranks).
    """
    names = [name for name in tensors if isinstance(provenance.get(name), Loaded)]
    distributed = group.collective
    device = collective_device()
    rank, world, first_rank = group.rank, group.size, group.first_global_rank
    expected = torch.zeros(len(names), dtype=torch.int64)
    actual = torch.zeros(len(names), dtype=torch.int64)
    with BlockReader() as reader, torch.no_grad():
        view_block = checkpoint_blocks(checkpoint, reader)
        for i, name in enumerate(names):
            tensor = tensors[name]
            if i % world == rank:
                expected[i] = _expected_checksum(name, tensor, adapter, view_block)
            if not isinstance(tensor, DTensor) or _owns_distinct_piece(tensor, first_rank):
                geometry = shard_geometry(tensor, name)
                actual[i] = checksum(local_shard(tensor), geometry.dim_indices, geometry.global_shape)
    is_dtensor = torch.tensor([isinstance(tensors[n], DTensor) for n in names], dtype=torch.bool)
    if distributed:
        both = torch.stack([expected, torch.where(is_dtensor, actual, torch.zeros_like(actual))]).to(device)
        dist.all_reduce(both, group=group.process_group)
        expected, reduced = both[0].cpu() % PRIME, both[1].cpu() % PRIME
        actual = torch.where(is_dtensor, reduced, actual)
    wrong = (expected != actual).to(torch.int64)
    if distributed:  # every rank raises, naming every tensor wrong anywhere
        wrong = wrong.to(device)
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=group.process_group)
        wrong = wrong.cpu()
    bad = [names[i] for i in torch.nonzero(wrong).flatten().tolist()]
    if bad:
        raise LoadVerificationError(
            f"{checkpoint.directory}: {len(bad)} tensor(s) differ from the checkpoint after loading: {summarize(bad)}"
        )
