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

from nemo_wrap.errors import InvalidSetupError


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy's facts and its one action.

    - ``options_class``: a frozen dataclass whose fields are the keyword options
      ``DistributedSetup.build`` accepts; it validates its own values in ``__post_init__``.
    - ``shards_on_meta``: whether it can shard a model that has no storage yet (each rank then
      allocates and reads only its own shards) or needs real full weights first.
    - ``shards_parameters``: whether parameters are split over the data-parallel axis (FSDP) or
      every rank holds them whole (DDP).
    - ``supports_tensor_parallel``: whether it composes with ``tp_size > 1`` (2-D mesh ``dp, tp``).
    - ``apply(model, mesh, options)``: shard over the setup's mesh after any tensor parallelism;
      returns the model (or, for wrappers, the wrapper).
    - ``check_available()``: raises :class:`StrategyUnavailableError` where it cannot run. Called
      when a model is sharded, never when a setup or plan is only described.
    - ``mixed_precision_options(options, compute_dtype, reduce_dtype)``: the options with the
      strategy's own mixed precision set, for strategies that cast parameters themselves (FSDP2);
      ``None`` for the others, under which mixed precision is ``torch.autocast``.
    """

    name: str
    options_class: type
    shards_on_meta: bool
    shards_parameters: bool
    supports_tensor_parallel: bool
    apply: Callable[[nn.Module, DeviceMesh, Any], nn.Module]
    check_available: Callable[[], None]
    mixed_precision_options: Callable[[Any, torch.dtype, torch.dtype], Any] | None = None

    def mesh_dim_names(self) -> tuple[str, ...]:
        return ("dp", "tp") if self.supports_tensor_parallel else ("dp",)


_REGISTRY: dict[str, StrategyEntry] = {}


def always_available() -> None:
    """The ``check_available`` of strategies torch itself runs on every backend (gloo, NCCL)."""


def register_strategy(entry: StrategyEntry) -> StrategyEntry:
    """Make ``entry`` available under ``entry.name`` (replacing an entry of that name)."""
    _REGISTRY[entry.name] = entry
    return entry


def strategy_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def strategy_entry(name: object) -> StrategyEntry:
    """The entry registered as ``name``; :class:`InvalidSetupError` naming the choices otherwise."""
    entry = _REGISTRY.get(name) if isinstance(name, str) else None
    if entry is None:
        raise InvalidSetupError(f"unknown strategy={name!r}; choose one of {list(_REGISTRY)}")
    return entry
