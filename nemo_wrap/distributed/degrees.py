"""Parallelism as degrees on one device mesh, in the names NeMo Automodel's users know.

A job of ``world_size`` ranks is split by degrees: pipeline stages (``pp``), data-parallel
replicas (``dp_replicate``) and shards (``dp_shard``), context-parallel ranks (``cp``) and
tensor-parallel ranks (``tp``), so ``world = pp · dp_replicate · dp_shard · cp · tp``; the shard
degree is what is left. Expert parallel (``ep``) is carved from the ranks that shard the dense
weights (``dp_shard · cp · tp``), as transformers' ``efsdp`` is, and adds no mesh dimension.

The mesh's dimensions come in that fixed order. The data-parallel dims are always there; another
size-1 dimension is dropped unless the strategy keeps it (fsdp2 keeps ``tp``, so a plain fsdp2 mesh
stays ``(dp, tp)``). With ``dp_replicate > 1`` the data-parallel dimension is split into
``dp_replicate`` × ``dp_shard``, and ``dp`` is their flattening (where data is dealt and losses are
averaged).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.validation import require_positive_int
from nemo_wrap.vocabulary import Vocabulary


class MeshDim(Vocabulary):
    """The names of the device mesh's dimensions. torch indexes a mesh by these strings; a degree a
    strategy takes (``StrategyEntry.degrees``) is the size of one of them."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    DP = "dp"  # dp_replicate × dp_shard, flattened
    CP = "cp"
    TP = "tp"
    EP = "ep"  # of the expert mesh
    EFSDP = "efsdp"  # of the expert mesh: the ranks that hold the same experts
    DP_SHARD_CP = "dp_shard_cp"  # flattened: what FSDP shards over under context parallel
    DP_CP = "dp_cp"  # flattened: what the loss is reduced over


# The keyword of DistributedSetup.build for each degree a strategy may take.
DEGREE_ARGUMENTS = {
    MeshDim.TP: "tp_size",
    MeshDim.CP: "cp_size",
    MeshDim.PP: "pp_size",
    MeshDim.EP: "ep_size",
    MeshDim.DP_REPLICATE: "dp_replicate_size",
}


@dataclass(frozen=True)
class ParallelDegrees:
    """How many ways each kind of parallelism splits the world (1: not used)."""

    dp_shard: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp_replicate: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: replicas × shards (data is dealt over these ranks, not over cp)."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """How many ranks hold the same experts (and FSDP-shard them): dp_shard · cp · tp over ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def stage_of(self, rank: int) -> int:
        """The pipeline stage of ``rank``: ``pp`` is every mesh's outermost dimension."""
        return rank // (self.world_size // self.pp)

    def mesh_layout(self, kept: tuple[MeshDim, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's shape and dimension names: the data-parallel dims always, the others when their
        size is above 1 or they are in ``kept``."""
        dims: list[tuple[str, int]] = [(MeshDim.PP, self.pp)]
        if self.dp_replicate > 1:
            dims += [(MeshDim.DP_REPLICATE, self.dp_replicate), (MeshDim.DP_SHARD, self.dp_shard)]
        else:
            dims.append((MeshDim.DP, self.dp_shard))
        dims += [(MeshDim.CP, self.cp), (MeshDim.TP, self.tp)]
        chosen = [(name, size) for name, size in dims if size > 1 or name in kept or name.startswith(MeshDim.DP)]
        return tuple(size for _, size in chosen), tuple(name for name, _ in chosen)

    def expert_mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The expert mesh, the same ranks viewed as ``(dp_replicate, efsdp, ep)`` (transformers'
        expert mesh): ``ep`` varies fastest, so an expert group is the tp group when ep == tp.
        Pipeline stages come first, as in the dense mesh: each stage's experts live on its own ranks."""
        dims = [(MeshDim.PP, self.pp)] if self.pp > 1 else []
        dims += [(MeshDim.DP_REPLICATE, self.dp_replicate)] if self.dp_replicate > 1 else []
        dims += [(MeshDim.EFSDP, self.efsdp), (MeshDim.EP, self.ep)]
        return tuple(size for _, size in dims), tuple(name for name, _ in dims)

    def expert_mesh_summary(self) -> str:
        return describe_mesh(*self.expert_mesh_layout())

    def describe_usage(self) -> list[str]:
        """Which mesh dimensions each model parallelism in use runs on (data parallel aside)."""
        lines = []
        if self.tp > 1:
            lines.append(f"tensor parallel over tp={self.tp}")
        if self.cp > 1:
            chunks = 2 * self.cp
            lines.append(
                f"context parallel over cp={self.cp}: every sequence cut in {chunks} chunks, each rank keeping "
                f"chunks i and {chunks - 1}−i; attention all-gathers keys and values (FSDP shards over dp_shard × cp)"
            )
        if self.pp > 1:
            lines.append(f"pipeline parallel over pp={self.pp} stages")
        if self.ep > 1:
            lines.append(
                f"expert parallel over ep={self.ep} of the dp_shard × cp × tp ranks (expert mesh "
                f"{self.expert_mesh_summary()}); dense layers keep their own sharding"
            )
        return lines


def describe_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """A mesh's named dims and sizes, e.g. ``dp_replicate=2, dp_shard=4, tp=2``."""
    return ", ".join(f"{name}={size}" for name, size in zip(names, shape, strict=True))


def derive_degrees(
    world_size: object, given: Mapping[str, object], accepted: tuple[MeshDim, ...], strategy: str
) -> ParallelDegrees:
    """Validate the degrees ``given`` (keyword names as in :data:`DEGREE_ARGUMENTS`) for a strategy
    that takes ``accepted``, and derive the shard degree. Raises :class:`InvalidSetupError` naming
    the argument, and the value that would work where there is one."""
    world = require_positive_int(world_size, "DistributedSetup.build: world_size", InvalidSetupError)
    sizes = {
        degree: require_positive_int(given[argument], f"DistributedSetup.build: {argument}", InvalidSetupError)
        for degree, argument in DEGREE_ARGUMENTS.items()
    }
    for degree, size in sizes.items():
        if size > 1 and degree not in accepted:
            raise InvalidSetupError(_not_taken(strategy, degree, size, accepted))
    fixed = sizes[MeshDim.PP] * sizes[MeshDim.DP_REPLICATE] * sizes[MeshDim.CP] * sizes[MeshDim.TP]
    if world % fixed != 0:
        parts = [
            f"{DEGREE_ARGUMENTS[d]}={sizes[d]}"
            for d in (MeshDim.PP, MeshDim.DP_REPLICATE, MeshDim.CP, MeshDim.TP)
            if sizes[d] > 1
        ]
        product = " · ".join(parts) + (f" (= {fixed})" if len(parts) > 1 else "")
        raise InvalidSetupError(
            f"DistributedSetup.build: world_size={world} is not divisible by {product}; the data-parallel "
            f"shard degree is world_size over that product, so world_size must be a multiple of {fixed}"
        )
    degrees = ParallelDegrees(
        world // fixed,
        sizes[MeshDim.TP],
        sizes[MeshDim.CP],
        sizes[MeshDim.PP],
        sizes[MeshDim.EP],
        sizes[MeshDim.DP_REPLICATE],
    )
    expert_ranks = degrees.dp_shard * degrees.cp * degrees.tp
    if expert_ranks % degrees.ep != 0:
        working = [n for n in range(1, expert_ranks + 1) if expert_ranks % n == 0]
        raise InvalidSetupError(
            f"DistributedSetup.build: ep_size={degrees.ep} does not divide the {expert_ranks} ranks that shard "
            f"the dense weights (dp_shard · cp · tp); choose ep_size from {working}"
        )
    return degrees


def _not_taken(strategy: str, degree: MeshDim, size: int, accepted: tuple[MeshDim, ...]) -> str:
    argument = DEGREE_ARGUMENTS[degree]
    taken = ", ".join(DEGREE_ARGUMENTS[d] for d in accepted) or "none"
    hint = f"; tp_size={size} with strategy='fsdp2'" if degree == MeshDim.TP else ""
    return (
        f"DistributedSetup.build: strategy={strategy!r} does not take {argument}, so {argument} must be 1 "
        f"(got {argument}={size}); it takes: {taken}{hint}"
    )
