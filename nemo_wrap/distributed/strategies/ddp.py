"""DDP: every rank holds the whole model (or, with tensor parallel, its tp shard); gradients are
all-reduced over the data-parallel ranks during backward.

torch's composable ``replicate`` is used instead of ``DistributedDataParallel(model)`` because it
keeps the model object (and its class) instead of hiding it behind a wrapper. It needs real
weights: rank 0's are broadcast to the others when it is applied.

With tensor parallel (DDP × TP) the classic ``replicate`` is wrong in silence: over DTensor
parameters its gradient all-reduce gives other losses than one process from the second step on
(measured on 4 gloo ranks). There torch's FSDP2-based ``replicate`` serves instead, per decoder
layer and root as FSDP2 groups them: it all-reduces DTensor gradients over ``dp`` and gives the
one-process losses. It works on the meta model, so the tensor-parallel slices are read per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_sharded_parameters
from torch.distributed.device_mesh import DeviceMesh

from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.distributed.strategies.registry import StrategyEntry, always_available, register_strategy


@dataclass(frozen=True)
class DDPOptions:
    """DDP has no tunables here: gradients are all-reduced over every data-parallel rank."""


def apply_ddp(model: nn.Module, mesh: DeviceMesh, options: DDPOptions) -> nn.Module:
    """Replicate ``model`` over the mesh's ``dp`` dimension (after any tensor parallel on ``tp``)."""
    names = mesh.mesh_dim_names or ()
    if MeshDim.TP in names and mesh[MeshDim.TP].size() > 1:
        for layer in decoder_layers(model):
            replicate_sharded_parameters(layer, mesh=mesh[MeshDim.DP])
        replicate_sharded_parameters(model, mesh=mesh[MeshDim.DP])
        return model
    replicate(model, device_mesh=mesh)  # the 1-D dp mesh
    return model


DDP = register_strategy(
    StrategyEntry(
        name="ddp",
        options_class=DDPOptions,
        shards_on_meta=False,
        shards_parameters=False,
        apply=apply_ddp,
        check_available=always_available,
        degrees=(MeshDim.TP,),
        traits=frozenset({Feature.REPLICATED}),
    )
)
