"""``verify=True``: prove, after loading, that the ranks together hold exactly the checkpoint.

Per tensor, an exact checksum of bit patterns keyed by global position (:mod:`.checksum`): it does
not depend on summation order, on how the tensor is sharded, or on which rank holds what — a value
in the wrong place changes it. The expected side re-reads the checkpoint (the one allowed second
read), each tensor on one rank (:func:`checking_rank`), window by window straight from the mapped
files as the adapter names them, in global coordinates — not through the loader's shard geometry,
which is what it checks; the actual side sums the local shards of the ranks that own a distinct
piece (replicas along ``Replicate`` mesh dims count once). Plain tensors, replicated by DDP, are
compared on every rank.

The expected side of plain tensors is taken during the load (:class:`ChecksumsWhileReading`), right
after each tensor is read and before its file pages are dropped: the second read then costs no page
faults (on SmolLM2-135M fp32 verify went from 1.7× to 1.4× the load). Only its timing is shared
with the loader; its windows and indices are the adapter's, whole tensors in global coordinates.
What bounds verify now is memory speed: it reads the model's bytes twice (the checkpoint's and the
ranks'), each pass an int8 product at ~14 GB/s here against ~23 GB/s for a plain float sum.

A 4-bit layer holds no copy of its checkpoint tensor, only bitsandbytes' encoding of it. For it,
verify re-reads the tensor whole, has bitsandbytes quantize it in one piece, and compares that
encoding (4-bit values, absmax, double quantization's statistics) with what the ranks hold — so it
proves the layer holds exactly the quantization of the checkpoint's bytes, whichever rows each rank
quantized while reading, at the cost of quantizing the model once more.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

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
from nemo_wrap.state_dict import EncodedWeight, StateDictAdapter


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


def checking_rank(name: str, group_size: int) -> int:
    """The rank of the group that re-reads tensor ``name`` from the checkpoint: a stable hash of the
    name, so the read pass and the audit agree without a list or a collective, and ranks re-read
    about equal shares of the tensors."""
    return zlib.crc32(name.encode()) % group_size


@dataclass
class ChecksumsWhileReading:
    """The expected side of ``verify``, taken by the read pass (an ``after_read`` callback): the
    checkpoint checksum of each loaded tensor this rank checks, while its pages are still mapped.
    ``view_block`` must be a second-read view (not counted as the load's bytes)."""

    adapter: StateDictAdapter
    view_block: BlockView
    group: RankGroup
    expected: dict[str, int] = field(default_factory=dict)

    def __call__(self, name: str, tensor: torch.Tensor, provenance: Provenance) -> None:
        if isinstance(provenance, Loaded) and checking_rank(name, self.group.size) == self.group.rank:
            self.expected[name] = _expected_checksum(name, tensor, self.adapter, self.view_block)


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


@dataclass(frozen=True)
class _Check:
    """One tensor's comparison: the checkpoint's checksum, computed on one rank, against what the
    ranks hold — their shards' checksums summed (``summed``: a DTensor), or each rank's whole copy."""

    name: str
    expected: Callable[[], int]
    actual: Callable[[], int]
    summed: bool


def _tensor_check(
    name: str, tensor: torch.Tensor, adapter: StateDictAdapter, view_block: BlockView, first_rank: int
) -> _Check:
    def actual() -> int:
        if isinstance(tensor, DTensor) and not _owns_distinct_piece(tensor, first_rank):
            return 0
        geometry = shard_geometry(tensor, name)
        return checksum(local_shard(tensor), geometry.dim_indices, geometry.global_shape)

    expected = partial(_expected_checksum, name, tensor, adapter, view_block)
    return _Check(name, expected, actual, isinstance(tensor, DTensor))


def _encoded_check(
    name: str, layer: EncodedWeight, adapter: StateDictAdapter, view_block: BlockView, group: RankGroup
) -> _Check:
    """An encoded (4-bit) weight: the layer's encoding of the checkpoint tensor, made again in one
    piece from a re-read, against the layer's tensors. Tensors beyond :attr:`~EncodedWeight.encoding`
    (double quantization's statistics) are held whole by every rank, so a sharded layer's expected
    sum counts them once per rank of the group."""
    sharded = isinstance(layer.get_parameter(layer.encoding[0]), DTensor)
    copies = group.size if sharded else 1

    def expected() -> int:
        whole = torch.empty(layer.weight_shape, dtype=layer.weight_dtype)
        for block in adapter.blocks(name, layer.weight_shape):
            with view_block(block.hf_key, block.source) as window:
                whole[block.target] = window
        parts = layer.encode(whole)
        total = sum(_whole_checksum(parts[t]) * (1 if t in layer.encoding else copies) for t in parts)
        return total % PRIME

    def actual() -> int:
        total = 0
        for tensor_name in layer.encoding:
            tensor = layer.get_parameter(tensor_name)
            if not isinstance(tensor, DTensor) or _owns_distinct_piece(tensor, group.first_global_rank):
                geometry = shard_geometry(tensor, f"{name}: {tensor_name}")
                total += checksum(local_shard(tensor), geometry.dim_indices, geometry.global_shape)
        statistics = [buffer for buffer_name, buffer in layer.named_buffers() if buffer_name not in layer.encoding]
        return (total + sum(_whole_checksum(buffer) for buffer in statistics)) % PRIME

    return _Check(name, expected, actual, sharded)


def _whole_checksum(tensor: torch.Tensor) -> int:
    return checksum(tensor, [range(size) for size in tensor.shape], tuple(tensor.shape))


def verify_load(
    tensors: dict[str, torch.Tensor],
    provenance: dict[str, Provenance],
    adapter: StateDictAdapter,
    checkpoint: Checkpoint,
    group: RankGroup,
    encoded: dict[str, EncodedWeight] | None = None,
    expected_so_far: Mapping[str, int] | None = None,
) -> None:
    """Raise :class:`LoadVerificationError` (on every rank of ``group``) naming each tensor that differs.

    ``group`` holds the same tensor names on every rank (the job, or one pipeline stage's ranks).
    ``encoded`` are the layers that hold a checkpoint tensor encoded (4-bit), by that tensor's name.
    ``expected_so_far``: checkpoint checksums already taken while reading
    (:class:`ChecksumsWhileReading`); the others are re-read here.
    """
    with BlockReader() as reader, torch.no_grad():
        view_block = checkpoint_blocks(checkpoint, reader)
        encoded = encoded or {}
        loaded = [name for name in {**tensors, **encoded} if isinstance(provenance.get(name), Loaded)]
        checks = [
            _encoded_check(name, encoded[name], adapter, view_block, group)
            if name in encoded
            else _tensor_check(name, tensors[name], adapter, view_block, group.first_global_rank)
            for name in loaded
        ]
        expected = torch.zeros(len(checks), dtype=torch.int64)
        actual = torch.zeros(len(checks), dtype=torch.int64)
        so_far = expected_so_far or {}
        for i, check in enumerate(checks):
            if checking_rank(check.name, group.size) == group.rank:
                expected[i] = so_far[check.name] if check.name in so_far else check.expected()
            actual[i] = check.actual()
    _raise_for_differences(checks, expected, actual, checkpoint, group)


def _raise_for_differences(
    checks: list[_Check], expected: torch.Tensor, actual: torch.Tensor, checkpoint: Checkpoint, group: RankGroup
) -> None:
    summed = torch.tensor([check.summed for check in checks], dtype=torch.bool)
    device = collective_device()
    if group.collective:
        both = torch.stack([expected, torch.where(summed, actual, torch.zeros_like(actual))]).to(device)
        dist.all_reduce(both, group=group.process_group)
        expected, reduced = both[0].cpu() % PRIME, both[1].cpu() % PRIME
        actual = torch.where(summed, reduced, actual)
    wrong = (expected != actual).to(torch.int64)
    if group.collective:  # every rank raises, naming every tensor wrong anywhere
        wrong = wrong.to(device)
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=group.process_group)
        wrong = wrong.cpu()
    bad = [checks[i].name for i in torch.nonzero(wrong).flatten().tolist()]
    if bad:
        raise LoadVerificationError(
            f"{checkpoint.directory}: {len(bad)} tensor(s) differ from the checkpoint after loading: {summarize(bad)}"
        )
