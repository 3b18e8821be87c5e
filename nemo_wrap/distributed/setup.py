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

from nemo_wrap.distributed.strategies import StrategyEntry, strategy_entry, strategy_names
from nemo_wrap.errors import DistributedStateError, InvalidSetupError
from nemo_wrap.validation import require_positive_int

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


def _check_sizes(entry: StrategyEntry, world_size: object, tp_size: object) -> tuple[int, int]:
    world = require_positive_int(world_size, "DistributedSetup.build: world_size", InvalidSetupError)
    tp = require_positive_int(tp_size, "DistributedSetup.build: tp_size", InvalidSetupError)
    if tp > 1 and not entry.supports_tensor_parallel:
        combining = [name for name in strategy_names() if strategy_entry(name).supports_tensor_parallel]
        raise InvalidSetupError(
            f"DistributedSetup.build: strategy={entry.name!r} does not combine with tensor parallel, so "
            f"tp_size must be 1 (got tp_size={tp}); use strategy={combining[0]!r} with tp_size={tp}"
        )
    if world % tp != 0:
        raise InvalidSetupError(f"DistributedSetup.build: world_size={world} is not divisible by tp_size={tp}")
    return world, tp


@dataclass(frozen=True)
class DistributedSetup:
    """How to parallelize: the strategy, the world it runs on, and its tensor-parallel degree.

    Build it with :meth:`build`, which validates every argument before any collective runs.
    """

    strategy: str
    world_size: int
    tp_size: int
    options: Any
    _mesh_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, strategy: str, world_size: int, tp_size: int = 1, **options: Any) -> DistributedSetup:
        """Validate and freeze a setup. Raises :class:`InvalidSetupError` naming the bad argument.

        ``tp_size == world_size`` means pure tensor parallel (no FSDP on the size-1 dp axis).
        Whether the strategy can run here (CUDA, optional packages) is checked when a model is
        sharded with it, not here: a setup may describe a job for another machine.
        """
        try:
            entry = strategy_entry(strategy)
        except InvalidSetupError as error:
            raise InvalidSetupError(f"DistributedSetup.build: {error}") from None
        world, tp = _check_sizes(entry, world_size, tp_size)
        return cls(entry.name, world, tp, _build_options(entry, options))

    # -- derived facts ------------------------------------------------------------------------
    @property
    def entry(self) -> StrategyEntry:
        """The strategy's registry entry: every strategy-specific fact comes from it."""
        return strategy_entry(self.strategy)

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many model replicas (or FSDP shards) there are."""
        return self.world_size // self.tp_size

    @property
    def parameter_shards(self) -> int:
        """Into how many pieces each parameter is split: over every rank under FSDP, else over tp."""
        return self.world_size if self.entry.shards_parameters else self.tp_size

    @property
    def uses_tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def uses_fsdp(self) -> bool:
        """Whether parameters are sharded over the dp axis (not on a size-1 axis: pure TP)."""
        return self.entry.shards_parameters and self.dp_size > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_size, self.tp_size) if self.entry.supports_tensor_parallel else (self.world_size,)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.entry.mesh_dim_names()

    def describe(self) -> str:
        """One readable line per fact, for logs, the CLI and the load plan."""
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape, strict=True))
        lines = [f"strategy {self.strategy} on {self.world_size} rank(s), mesh ({mesh})"]
        if not self.entry.shards_parameters:
            lines.append(f"every rank holds the whole model; gradients all-reduced over dp={self.dp_size}")
        elif self.uses_fsdp:
            lines.append(f"parameters sharded over dp={self.dp_size} ({self.options})")
        else:
            lines.append("no FSDP: the dp axis has size 1")
        if self.uses_tensor_parallel:
            lines.append(f"tensor parallel over tp={self.tp_size}")
        return "\n".join(lines)

    # -- the mesh, made on first use ----------------------------------------------------------
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
            self._mesh_cache.update(group=world, mesh=mesh)
        return self._mesh_cache["mesh"]
