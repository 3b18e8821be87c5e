"""Tensor parallelism for ``NeMoQwen3ForCausalLM``: the shared decoder plan plus the per-head q/k norms."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from nemo_wrap.distributed.sharding.tensor_parallel import ReplicateWithGradientSum
from nemo_wrap.models.common.parallelize import decoder_tensor_parallel_plan

__all__ = ["tensor_parallel_plan"]


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """The decoder plan, plus gradient sums for ``q_norm``/``k_norm``, which only see local heads."""
    return {
        **decoder_tensor_parallel_plan(),
        "model.layers.*.self_attn.q_norm": ReplicateWithGradientSum(),
        "model.layers.*.self_attn.k_norm": ReplicateWithGradientSum(),
    }

