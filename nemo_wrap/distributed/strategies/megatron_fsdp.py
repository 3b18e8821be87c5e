"""Megatron-FSDP through the real ``megatron-fsdp`` package (the ``megatron`` extra, CUDA only).

It shards parameters, gradients and optimizer state over the ``dp`` mesh with each decoder layer as
one FSDP unit. Unlike torch's composable managers it returns its own ``MegatronFSDP`` wrapper; the
model object lives on as ``wrapper.module`` and keeps its class. The optimizer must then be built
on the wrapper's parameters and passed through ``megatron_fsdp.fully_shard_optimizer``. It needs
real weights on the GPU, so the checkpoint is read before it is applied.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.distributed.strategies.registry import StrategyEntry, register_strategy
from nemo_wrap.errors import InvalidSetupError, StrategyUnavailableError

_ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class MegatronFSDPOptions:
    """``zero_dp_strategy``: what is sharded — 0 nothing, 1 optimizer state, 2 + gradients, 3 + parameters."""

    zero_dp_strategy: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.zero_dp_strategy, bool) or self.zero_dp_strategy not in _ZERO_STAGES:
            raise InvalidSetupError(f"zero_dp_strategy must be one of {_ZERO_STAGES}, got {self.zero_dp_strategy!r}")


def apply_megatron_fsdp(model: nn.Module, mesh: DeviceMesh, options: MegatronFSDPOptions) -> nn.Module:
    """Wrap ``model`` (real weights on CUDA) in Megatron-FSDP over the 1-D ``dp`` mesh."""
    from megatron_fsdp import fully_shard_model  # the optional extra: imported only when asked for

    layer_class = type(decoder_layers(model)[0])
    return fully_shard_model(
        model,
        device_mesh=mesh,
        dp_shard_dim=MeshDim.DP,
        fsdp_unit_modules=[layer_class],
        zero_dp_strategy=options.zero_dp_strategy,
        device=torch.device("cuda", torch.cuda.current_device()),
    )


def check_megatron_fsdp_available() -> None:
    """megatron-fsdp calls ``torch.cuda`` directly and ships as an optional extra."""
    if not torch.cuda.is_available():
        raise StrategyUnavailableError(
            "strategy='megatron_fsdp' needs CUDA (megatron-fsdp calls torch.cuda directly) and none "
            "is available here; use strategy='fsdp2', which shards the same way and runs on CPU/gloo"
        )
    if importlib.util.find_spec("megatron_fsdp") is None:
        raise StrategyUnavailableError(
            "strategy='megatron_fsdp' needs the megatron-fsdp package: pip install 'nemo_wrap[megatron]'"
        )


MEGATRON_FSDP = register_strategy(
    StrategyEntry(
        name="megatron_fsdp",
        options_class=MegatronFSDPOptions,
        shards_on_meta=False,
        shards_parameters=True,
        apply=apply_megatron_fsdp,
        check_available=check_megatron_fsdp_available,
        traits=frozenset({Feature.FLAT_BUFFERS}),
    )
)
