"""``DistributedSetup``: a frozen, validated description of how a model is to be parallelized.

It is pure data until a device mesh is needed, so a setup for 8 ranks can be built, compared and
printed from one process (the load plan describes a job before it is launched, even for a
strategy that cannot run on this machine). Every fact about the strategy comes from its registry
entry (:mod:`nemo_wrap.distributed.strategies`). The mesh is made lazily, on first use inside an
initialized process group whose size matches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.degrees import MeshDim, ParallelDegrees, derive_degrees, describe_mesh
from nemo_wrap.distributed.pipeline.layout import PipelineOptions, PipelineSchedule
from nemo_wrap.distributed.strategies import StrategyEntry, strategy_entry
from nemo_wrap.distributed.strategies.registry import SINGLE_PROCESS, NoOptions
from nemo_wrap.errors import DistributedStateError, InvalidSetupError, UnsupportedSetupError

# The built-in strategies' names, for type checkers; registered strategies are accepted too.
Strategy = Literal["ddp", "fsdp2", "megatron_fsdp"]


def _build_options(entry: StrategyEntry, options: dict[str, Any]) -> Any:
    accepted = [f.name for f in dataclasses.fields(entry.options_class)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InvalidSetupError(
            f"DistributedSetup.build: unknown option(s) {unknown} for strategy={entry.name!r}; "
            f"accepted: {accepted or 'none'}"
        )
    try:
        return entry.options_class(**options)
    except InvalidSetupError as error:
        raise InvalidSetupError(f"DistributedSetup.build: {error}") from None


@dataclass(frozen=True)
class DistributedSetup:
    """How to parallelize: the strategy, the world it runs on, and the degree of each parallelism.

    Build it with :meth:`build`, which validates every argument before any collective runs. A
    world of one is a setup too (:meth:`single_process`): the code below the public API never
    asks whether there is a setup, only what it says.
    """

    strategy: str
    degrees: ParallelDegrees
    options: Any
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)  # schedule and layer split (pp > 1)
    sequence_parallel: bool = False  # tp's residual stream cut along the sequence between blocks
    _mesh_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        strategy: str,
        world_size: int,
        tp_size: int = 1,
        cp_size: int = 1,
        pp_size: int = 1,
        ep_size: int = 1,
        dp_replicate_size: int = 1,
        pp_schedule: str = "1f1b",
        pp_layer_split: tuple[int, ...] | list[int] | None = None,
        sequence_parallel: bool = False,
        **options: Any,
    ) -> DistributedSetup:
        """Validate and freeze a setup. Raises :class:`InvalidSetupError` naming the bad argument.

        The data-parallel shard degree is derived: ``world_size / (pp · dp_replicate · cp · tp)``.
        ``tp_size == world_size`` means pure tensor parallel (no FSDP on the size-1 dp axis).
        Whether the strategy can run here (CUDA, optional packages) is checked when a model is
        sharded with it, not here: a setup may describe a job for another machine.
        ``pp_schedule`` is torch's pipeline schedule (``"1f1b"`` or ``"gpipe"``), ``pp_layer_split``
        the decoder layers per stage (default: balanced). ``sequence_parallel`` cuts tensor
        parallel's residual stream along the sequence between blocks (Megatron's sequence parallel):
        the same bytes exchanged, ``1/tp`` of the activations between blocks kept.
        """
        try:
            entry = strategy_entry(strategy)
        except InvalidSetupError as error:
            raise InvalidSetupError(f"DistributedSetup.build: {error}") from None
        if not entry.collective:
            raise InvalidSetupError(
                f"DistributedSetup.build: strategy={strategy!r} is no strategy to build: pass "
                "distributed_setup=None (or DistributedSetup.single_process()) for one process"
            )
        given = {"tp_size": tp_size, "cp_size": cp_size, "pp_size": pp_size, "ep_size": ep_size}
        given["dp_replicate_size"] = dp_replicate_size
        degrees = derive_degrees(world_size, given, entry.degrees, entry.name)
        split = None if pp_layer_split is None else tuple(pp_layer_split)
        PipelineOptions(pp_schedule, split).check(degrees.pp)
        pipeline = PipelineOptions(PipelineSchedule(pp_schedule), split)
        if sequence_parallel and degrees.tp == 1:
            raise InvalidSetupError(
                "DistributedSetup.build: sequence_parallel=True cuts tensor parallel's activations, and "
                "tp_size=1: pass tp_size > 1 or sequence_parallel=False"
            )
        return cls(entry.name, degrees, _build_options(entry, options), pipeline, sequence_parallel)

    @classmethod
    def single_process(cls) -> DistributedSetup:
        """This process alone: the whole model here, no mesh, no collective, whatever process group
        exists (so rank 0 may load, evaluate and save a model by itself while the others wait)."""
        return cls(SINGLE_PROCESS.name, ParallelDegrees(dp_shard=1), NoOptions())

    @classmethod
    def given(cls, distributed_setup: DistributedSetup | None) -> DistributedSetup:
        """The public keyword's value as a setup: ``None`` means :meth:`single_process`. The one
        place that ``None`` is read; everything below takes the setup this returns."""
        return cls.single_process() if distributed_setup is None else distributed_setup

    # -- derived facts ------------------------------------------------------------------------
    @property
    def entry(self) -> StrategyEntry:
        """The strategy's registry entry: every strategy-specific fact comes from it."""
        return strategy_entry(self.strategy)

    @property
    def is_collective(self) -> bool:
        """Whether its model acts with other ranks: loads, saves and steps are collective (every
        strategy but the single process's, even on a world of one rank)."""
        return self.entry.collective

    def rank_group(self) -> RankGroup:
        """Who acts together on its model: every rank of the job, or this process alone."""
        return RankGroup.job() if self.is_collective else RankGroup.local()

    @property
    def world_size(self) -> int:
        return self.degrees.world_size

    @property
    def tp_size(self) -> int:
        return self.degrees.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: model replicas × FSDP shards; data loaders deal rows over it."""
        return self.degrees.dp

    @property
    def parameter_shards(self) -> int:
        """Into how many pieces each parameter is split: over dp_shard × cp × tp under FSDP (replicas
        hold the same pieces), else over tp."""
        degrees = self.degrees
        return degrees.dp_shard * degrees.cp * degrees.tp if self.entry.shards_parameters else degrees.tp

    @property
    def uses_tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def uses_fsdp(self) -> bool:
        """Whether parameters are sharded over the dp axis (not on a size-1 axis: pure TP)."""
        return self.entry.shards_parameters and self.dp_size > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.degrees.mesh_layout(self.entry.kept_mesh_dims)[0]

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.degrees.mesh_layout(self.entry.kept_mesh_dims)[1]

    def mesh_summary(self) -> str:
        """The mesh's named dims and sizes, e.g. ``dp_replicate=2, dp_shard=4, tp=2``."""
        return describe_mesh(self.mesh_shape, self.mesh_dim_names)

    def describe(self) -> str:
        """One readable line per fact, for logs, the CLI and the load plan."""
        lines = [f"strategy {self.strategy} on {self.world_size} rank(s), mesh ({self.mesh_summary()})"]
        if not self.entry.shards_parameters:
            lines.append(f"every rank holds the whole model; gradients all-reduced over dp={self.dp_size}")
        elif self.uses_fsdp and self.degrees.dp_replicate == 1:
            lines.append(f"parameters sharded over dp={self.dp_size} ({self.options})")
        elif not self.uses_fsdp:
            lines.append("no FSDP: the dp axis has size 1")
        return "\n".join(lines + self.describe_degrees())

    def describe_degrees(self) -> list[str]:
        """What each degree beyond plain data parallel does, and on which mesh dims (none: [])."""
        lines = []
        if self.uses_fsdp and self.degrees.dp_replicate > 1:
            lines.append(
                f"HSDP: parameters sharded over dp_shard={self.degrees.dp_shard} inside each of "
                f"dp_replicate={self.degrees.dp_replicate} replicas (reduce-scatter inside a replica, "
                f"all-reduce across replicas; {self.options}); data dealt over dp = dp_replicate × dp_shard "
                f"= {self.dp_size}"
            )
        if self.degrees.pp > 1:
            split = (
                "balanced"
                if self.pipeline.layer_split is None
                else f"layers per stage {list(self.pipeline.layer_split)}"
            )
            lines.append(f"pipeline schedule {self.pipeline.schedule} (torch.distributed.pipelining), {split}")
        if self.sequence_parallel:
            lines.append(
                f"sequence parallel: between blocks each tp rank holds 1/{self.tp_size} of every sequence "
                "(blocks all-gather their input and reduce-scatter their output)"
            )
        return lines + self.degrees.describe_usage()

    def dp_rank(self) -> int:
        """This rank's place among the data-parallel ranks (0 … dp_size - 1): where data loaders,
        train_step, evaluate and the SFT recipe take their share."""
        return self.device_mesh()[MeshDim.DP].get_local_rank() if self.dp_size > 1 else 0

    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (losses and token counts are summed there), or None."""
        return self.device_mesh()[MeshDim.DP].get_group() if self.dp_size > 1 else None

    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (which part of each sequence it keeps)."""
        return self.device_mesh()[MeshDim.CP].get_local_rank() if self.degrees.cp > 1 else 0

    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel group (its ranks see the same batch, each a part of every sequence)."""
        return self.device_mesh()[MeshDim.CP].get_group() if self.degrees.cp > 1 else None

    def loss_group(self) -> dist.ProcessGroup | None:
        """Where per-rank token-loss sums add up to the batch's: dp, times cp (each cp rank holds a
        part of every sequence's tokens)."""
        if self.degrees.cp == 1:
            return self.dp_group()
        return self.device_mesh()[MeshDim.DP_CP].get_group()

    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 … pp_size - 1); 0 without pipeline parallel."""
        return self.device_mesh()[MeshDim.PP].get_local_rank() if self.degrees.pp > 1 else 0

    # -- the meshes, made on first use ---------------------------------------------------------
    def expert_mesh(self) -> DeviceMesh:
        """The same ranks viewed as ``(dp_replicate, efsdp, ep)`` for the experts (expert parallel
        only): a rank's experts are set by its ``ep`` coordinate, FSDP shards them over the rest."""
        if self.degrees.ep == 1:
            raise UnsupportedSetupError("expert_mesh(): this setup has ep_size=1 (no expert parallel)")
        dense = self.device_mesh()  # checks the process group first
        if self._mesh_cache.get("experts_of") is not dense:
            shape, names = self.degrees.expert_mesh_layout()
            self._mesh_cache.update(experts=init_device_mesh(dense.device_type, shape, mesh_dim_names=names))
            self._mesh_cache["experts_of"] = dense
        return self._mesh_cache["experts"]

    def expert_sharding_mesh(self) -> DeviceMesh:
        """Where FSDP shards a run of experts: ``efsdp`` (with ``dp_replicate`` under HSDP)."""
        mesh = self.expert_mesh()
        return mesh[MeshDim.DP_REPLICATE, MeshDim.EFSDP] if self.degrees.dp_replicate > 1 else mesh[MeshDim.EFSDP]

    def device_mesh(self) -> DeviceMesh:
        """The device mesh for this setup, created once per process group.

        Raises :class:`DistributedStateError` when no process group exists or its size differs
        from ``world_size`` — checked locally, before any collective, so no rank hangs.
        """
        if not dist.is_initialized():
            raise DistributedStateError(
                f"DistributedSetup(strategy={self.strategy!r}, world_size={self.world_size}) needs a "
                "process group: call nemo_wrap.initialize_distributed() first"
            )
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise DistributedStateError(
                f"DistributedSetup was built for world_size={self.world_size}, but the process group "
                f"has {actual} rank(s); build it with world_size=initialize_distributed().world_size"
            )
        world = dist.group.WORLD
        if self._mesh_cache.get("group") is not world:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
            _flatten_joined_dims(mesh, self.mesh_dim_names)
            self._mesh_cache.update(group=world, mesh=mesh)
        return self._mesh_cache["mesh"]


def _flatten_joined_dims(mesh: DeviceMesh, names: tuple[str, ...]) -> None:
    """Name the joined dims torch's (torchtitan's) way, ``_flatten``: ``dp`` (data is dealt there)
    from ``dp_replicate × dp_shard``; with context parallel, ``dp_cp`` (losses add up there) and
    the dims FSDP shards over, ``dp_shard_cp`` (HSDP) — FSDP shards over dp_shard × cp."""
    if MeshDim.DP_REPLICATE in names:
        mesh[MeshDim.DP_REPLICATE, MeshDim.DP_SHARD]._flatten(MeshDim.DP)
    if MeshDim.CP not in names:
        return
    if MeshDim.DP_REPLICATE in names:
        mesh[MeshDim.DP_SHARD, MeshDim.CP]._flatten(MeshDim.DP_SHARD_CP)
        mesh[MeshDim.DP_REPLICATE, MeshDim.DP_SHARD, MeshDim.CP]._flatten(MeshDim.DP_CP)
    else:
        mesh[MeshDim.DP, MeshDim.CP]._flatten(MeshDim.DP_CP)
