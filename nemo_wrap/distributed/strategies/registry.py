"""The strategy registry: what each parallelization strategy is, as data that the rest reads.

``DistributedSetup`` (validation, mesh shape), the load plan (shard before or after the weights
are read) and sharding (how to apply it) all ask the strategy's :class:`StrategyEntry`; nothing
else switches on strategy names. Adding a strategy is one module under ``strategies/`` that calls
:func:`register_strategy`, plus one import line in ``strategies/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.errors import DuplicateRegistrationError, InvalidSetupError


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy's facts and its one action.

    - ``options_class``: a frozen dataclass whose fields are the keyword options
      ``DistributedSetup.build`` accepts; it validates its own values in ``__post_init__``.
    - ``shards_on_meta``: whether it can shard a model that has no storage yet (each rank then
      allocates and reads only its own shards) or needs real full weights first.
    - ``shards_parameters``: whether parameters are split over the data-parallel axis (FSDP) or
      every rank holds them whole (DDP).
    - ``degrees``: the parallel degrees it takes besides its data-parallel one, in
      :data:`~nemo_wrap.distributed.degrees.DEGREE_ARGUMENTS`' names (``"tp"``, ``"dp_replicate"``,
      ``"cp"``, ``"pp"``, ``"ep"``); ``DistributedSetup.build`` refuses any other above 1.
    - ``kept_mesh_dims``: mesh dimensions besides the data-parallel ones that it keeps at size 1
      (the rest of size 1 are dropped).
    - ``apply(model, mesh, options)``: shard over the setup's mesh after any tensor parallelism;
      returns the model (or, for wrappers, the wrapper).
    - ``check_available()``: raises :class:`StrategyUnavailableError` where it cannot run. Called
      when a model is sharded, never when a setup or plan is only described.
    - ``shard_experts(experts, mesh, options, gradient_divide_factor)``: shard each experts module
      over ``mesh`` (the ranks holding the same experts) before ``apply``; ``None`` for strategies
      that do not take expert parallel.
    - ``mixed_precision_options(options, compute_dtype, reduce_dtype)``: the options with the
      strategy's own mixed precision set, for strategies that cast parameters themselves (FSDP2);
      ``None`` for the others, under which mixed precision is ``torch.autocast``.
    - ``collective``: whether a model under it acts with other ranks (loads, saves and steps are
      collective). Only the single-process entry says no: its model is this process's alone.
    - ``traits``: the :class:`~nemo_wrap.distributed.combinations.Feature` values it brings to a job
      (DDP replicates the model, Megatron-FSDP keeps flat buffers), which the combination table
      reads to refuse what they do not compose with.
    """

    name: str
    options_class: type
    shards_on_meta: bool
    shards_parameters: bool
    apply: Callable[[nn.Module, DeviceMesh, Any], nn.Module]
    check_available: Callable[[], None]
    degrees: tuple[MeshDim, ...] = ()
    kept_mesh_dims: tuple[MeshDim, ...] = ()
    mixed_precision_options: Callable[[Any, torch.dtype, torch.dtype], Any] | None = None
    shard_experts: Callable[[list[nn.Module], DeviceMesh, Any, int], None] | None = None
    collective: bool = True
    traits: frozenset[Feature] = frozenset()


@dataclass(frozen=True)
class NoOptions:
    """The single-process entry takes no options."""


def _keep_whole(model: nn.Module, mesh: DeviceMesh, options: NoOptions) -> nn.Module:
    return model


def always_available() -> None:
    """The ``check_available`` of strategies torch itself runs on every backend (gloo, NCCL)."""


SINGLE_PROCESS = StrategyEntry(
    name="single_process",
    options_class=NoOptions,
    shards_on_meta=False,
    shards_parameters=False,
    apply=_keep_whole,
    check_available=always_available,
    collective=False,
)
"""A world of one: the whole model in this process, no mesh, no collective — what
``distributed_setup=None`` means. Not in the registry: ``DistributedSetup.build`` cannot name it,
only :meth:`~nemo_wrap.distributed.setup.DistributedSetup.single_process` makes it."""


_REGISTRY: dict[str, StrategyEntry] = {}


def register_strategy(entry: StrategyEntry) -> StrategyEntry:
    """Make ``entry`` available under ``entry.name``; a name already taken raises (replacing a
    strategy in silence would change what every setup of that name means)."""
    if entry.name in _REGISTRY:
        raise DuplicateRegistrationError(f"register_strategy: a strategy named {entry.name!r} is already registered")
    _REGISTRY[entry.name] = entry
    return entry


def strategy_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def strategy_entry(name: object) -> StrategyEntry:
    """The entry registered as ``name`` (or the single-process one); :class:`InvalidSetupError`
    naming the choices otherwise."""
    known = {**_REGISTRY, SINGLE_PROCESS.name: SINGLE_PROCESS}
    entry = known.get(name) if isinstance(name, str) else None
    if entry is None:
        raise InvalidSetupError(f"unknown strategy={name!r}; choose one of {list(_REGISTRY)}")
    return entry
