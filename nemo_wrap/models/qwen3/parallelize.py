"""Tensor parallelism for ``NeMoQwen3ForCausalLM``: the shared decoder plan plus the per-head q/k norms."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from nemo_wrap.models.common.parallelize import (
    ReplicateWithGradientSum,
    apply_tensor_parallel,
    check_tensor_parallel_compatible,
    decoder_tensor_parallel_plan,
)
from nemo_wrap.models.qwen3.model import NeMoQwen3ForCausalLM

__all__ = ["check_tensor_parallel_compatible", "parallelize_qwen3", "tensor_parallel_plan"]


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """The decoder plan, plus gradient sums for ``q_norm``/``k_norm``, which only see local heads."""
    return {
        **decoder_tensor_parallel_plan(),
        "model.layers.*.self_attn.q_norm": ReplicateWithGradientSum(),
        "model.layers.*.self_attn.k_norm": ReplicateWithGradientSum(),
    }


def parallelize_qwen3(model: NeMoQwen3ForCausalLM, tp_mesh: DeviceMesh) -> NeMoQwen3ForCausalLM:
    """Apply :func:`tensor_parallel_plan` over ``tp_mesh`` in place (ties restored); returns ``model``."""
    return apply_tensor_parallel(model, tp_mesh, tensor_parallel_plan())
