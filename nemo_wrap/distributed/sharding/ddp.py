"""DDP: every rank holds the whole model; gradients are all-reduced during backward.

torch's composable ``replicate`` is used instead of ``DistributedDataParallel(model)`` because it
keeps the model object (and its class) instead of hiding it behind a wrapper.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Replicate ``model`` over ``mesh`` (1-D); rank 0's weights are broadcast to the others."""
    replicate(model, device_mesh=mesh)
    return model
