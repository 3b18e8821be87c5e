"""Gradient-norm clipping across parameters that live on different device meshes.

Under FSDP2 over tensor parallel, tensor-parallel weights are DTensors on the 2-D (dp, tp) mesh
while norms and biases that tensor parallel leaves alone sit on the 1-D dp mesh;
``torch.nn.utils.clip_grad_norm_`` raises on such a mix. Here each mesh's gradients are reduced to
one norm on their own mesh (a DTensor norm is exact over its shards), the per-mesh norms are
combined as plain numbers, and every gradient is scaled by the same factor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm


def _mesh_key(gradient: torch.Tensor) -> object:
    return gradient.device_mesh if isinstance(gradient, DTensor) else None


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return that norm.

    Every rank must call it (DTensor norms are collectives over their mesh); all ranks get the same
    total. Plain-tensor gradients are taken as already identical across ranks (DDP all-reduces).
    """
    gradients = [p.grad for p in parameters if p.grad is not None]
    total = gradient_norm(gradients, norm_type)
    scale_gradients_(gradients, total, max_norm)
    return total


def gradient_norm(gradients: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all ``gradients`` together, whatever meshes they live on (see module doc)."""
    if not gradients:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for gradient in gradients:
        groups.setdefault(_mesh_key(gradient), []).append(gradient)
    group_norms = []
    for group in groups.values():
        norm = get_total_norm(group, norm_type=norm_type)
        group_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return get_total_norm(group_norms, norm_type=norm_type)


def scale_gradients_(gradients: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale ``gradients`` so that a norm of ``total`` becomes at most ``max_norm`` (torch's rule)."""
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if coefficient < 1.0:
        for gradient in gradients:
            gradient.mul_(coefficient)
