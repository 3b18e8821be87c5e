"""``DistributedSetup``: a frozen, validated description of how a model is to be parallelized.

It is pure data until a device mesh is needed, so a setup for 8 ranks can be built, compared and
printed from one process (the load plan describes a job before it is launched). The mesh is made
lazily, on first use inside an initialized process group whose size matches.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nemo_wrap.errors import DistributedStateError, InvalidSetupError, StrategyUnavailableError

Strategy = Literal["ddp", "fsdp2", "megatron_fsdp"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


@dataclass(frozen=True)
class DDPOptions:
    """DDP has no tunables here yet: gradients are all-reduced over every rank."""


@dataclass(frozen=True)
class FSDP2Options:
    """Options handed to ``torch.distributed.fsdp.fully_shard``.

    ``param_dtype``/``reduce_dtype`` form its ``MixedPrecisionPolicy`` (``None`` keeps the
    parameters' dtype); ``reshard_after_forward=False`` trades memory for one all-gather less.
    """

    reshard_after_forward: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class MegatronFSDPOptions:
    """Megatron-FSDP runs with its defaults; options arrive when its manager does."""


_OPTIONS_BY_STRATEGY: dict[str, type] = {
    "ddp": DDPOptions,
    "fsdp2": FSDP2Options,
    "megatron_fsdp": MegatronFSDPOptions,
}
StrategyOptions = DDPOptions | FSDP2Options | MegatronFSDPOptions


def _require_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidSetupError(f"DistributedSetup.build: {name} must be a positive int, got {value!r}")
    return value


def _build_options(strategy: str, options: dict[str, Any]) -> StrategyOptions:
    options_class = _OPTIONS_BY_STRATEGY[strategy]
    accepted = [f.name for f in dataclasses.fields(options_class)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise InvalidSetupError(
            f"DistributedSetup.build: unknown option(s) {unknown} for strategy={strategy!r}; "
            f"accepted: {accepted or 'none'}"
        )
    built = options_class(**options)
    for name in ("param_dtype", "reduce_dtype"):
        value = getattr(built, name, None)
        if value is not None and not isinstance(value, torch.dtype):
            raise InvalidSetupError(f"DistributedSetup.build: {name} must be a torch.dtype or None, got {value!r}")
    if not isinstance(getattr(built, "reshard_after_forward", True), bool):
        raise InvalidSetupError("DistributedSetup.build: reshard_after_forward must be a bool")
    return built


def _check_strategy_available(strategy: str, tp_size: int) -> None:
    if strategy != "megatron_fsdp":
        return
    if not torch.cuda.is_available():
        raise StrategyUnavailableError(
            "strategy='megatron_fsdp' needs CUDA (megatron-fsdp calls torch.cuda directly) and none "
            "is available here; use strategy='fsdp2', which shards the same way and runs on CPU/gloo"
        )
    if tp_size > 1:
        raise InvalidSetupError(
            "DistributedSetup.build: strategy='megatron_fsdp' supports tp_size=1 only; "
            "use strategy='fsdp2' with tp_size for FSDP over tensor parallel"
        )
    if importlib.util.find_spec("megatron_fsdp") is None:
        raise StrategyUnavailableError(
            "strategy='megatron_fsdp' needs the megatron-fsdp package: pip install 'nemo_wrap[megatron]'"
        )


@dataclass(frozen=True)
class DistributedSetup:
    """How to parallelize: the strategy, the world it runs on, and its tensor-parallel degree.

    Build it with :meth:`build`, which validates every argument before any collective runs.
    """

    strategy: Strategy
    world_size: int
    tp_size: int
    options: StrategyOptions
    _mesh_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, strategy: str, world_size: int, tp_size: int = 1, **options: Any) -> DistributedSetup:
        """Validate and freeze a setup. Raises :class:`InvalidSetupError` naming the bad argument.

        ``tp_size == world_size`` means pure tensor parallel (no FSDP on the size-1 dp axis).
        ``strategy='megatron_fsdp'`` raises :class:`StrategyUnavailableError` where CUDA is absent.
        """
        if strategy not in STRATEGIES:
            raise InvalidSetupError(
                f"DistributedSetup.build: unknown strategy={strategy!r}; choose one of {list(STRATEGIES)}"
            )
        world_size = _require_positive_int("world_size", world_size)
        tp_size = _require_positive_int("tp_size", tp_size)
        if strategy == "ddp" and tp_size > 1:
            raise InvalidSetupError(
                f"DistributedSetup.build: strategy='ddp' replicates whole models, so tp_size must be 1 "
                f"(got tp_size={tp_size}); use strategy='fsdp2' with tp_size={tp_size} for tensor parallel"
            )
        if world_size % tp_size != 0:
            raise InvalidSetupError(
                f"DistributedSetup.build: world_size={world_size} is not divisible by tp_size={tp_size}"
            )
        built_options = _build_options(strategy, options)
        _check_strategy_available(strategy, tp_size)
        return cls(strategy, world_size, tp_size, built_options)

    # -- derived facts ------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Data-parallel degree: how many model replicas (or FSDP shards) there are."""
        return self.world_size // self.tp_size

    @property
    def uses_tensor_parallel(self) -> bool:
        return self.tp_size > 1

    @property
    def uses_fsdp(self) -> bool:
        """Whether parameters are sharded over the dp axis (not on a size-1 axis: pure TP)."""
        return self.strategy in ("fsdp2", "megatron_fsdp") and self.dp_size > 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_size, self.tp_size) if self.strategy == "fsdp2" else (self.world_size,)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("dp", "tp") if self.strategy == "fsdp2" else ("dp",)

    def describe(self) -> str:
        """One readable line per fact, for logs, the CLI and the load plan."""
        mesh = ", ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        lines = [f"strategy {self.strategy} on {self.world_size} rank(s), mesh ({mesh})"]
        if self.strategy == "ddp":
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
