"""Megatron-FSDP through the real ``megatron-fsdp`` package (the ``megatron`` extra, CUDA only).

It shards parameters, gradients and optimizer state (ZeRO-3) with each decoder layer as one FSDP
unit. Unlike torch's composable managers it returns its own ``MegatronFSDP`` wrapper; the model
object lives on as ``wrapper.module`` and keeps its class. The optimizer must then be built on the
wrapper's parameters and passed through ``megatron_fsdp.fully_shard_optimizer``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from nemo_wrap.distributed.sharding.fsdp2 import decoder_layers


def apply_megatron_fsdp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Wrap ``model`` (real weights on CUDA) in Megatron-FSDP over the 1-D ``dp`` mesh."""
    from megatron_fsdp import fully_shard_model  # the optional extra: imported only when asked for

    layer_class = type(decoder_layers(model)[0])
    return fully_shard_model(
        model,
        device_mesh=mesh,
        dp_shard_dim="dp",
        fsdp_unit_modules=[layer_class],
        zero_dp_strategy=3,
        device=torch.device("cuda", torch.cuda.current_device()),
    )
