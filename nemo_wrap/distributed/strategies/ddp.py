"""DDP: every rank holds the whole model; gradients are all-reduced during backward.

torch's composable ``replicate`` is used instead of ``DistributedDataParallel(model)`` because it
keeps the model object (and its class) instead of hiding it behind a wrapper. It needs real
weights: rank 0's are broadcast to the others when it is applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh

from nemo_wrap.distributed.strategies.registry import StrategyEntry, always_available, register_strategy


@dataclass(frozen=True)
class DDPOptions:
    """DDP has no tunables here: gradients are all-reduced over every rank."""


def apply_ddp(model: nn.Module, mesh: DeviceMesh, options: DDPOptions) -> nn.Module:
    """Replicate ``model`` over the 1-D ``mesh``."""
    replicate(model, device_mesh=mesh)
    return model


DDP = register_strategy(
    StrategyEntry(
        name="ddp",
        options_class=DDPOptions,
        shards_on_meta=False,
        shards_parameters=False,
        supports_tensor_parallel=False,
        apply=apply_ddp,
        check_available=always_available,
    )
)
