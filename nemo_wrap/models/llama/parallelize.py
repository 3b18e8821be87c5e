"""Tensor parallelism for ``NeMoLlamaForCausalLM``: the shared decoder plan as is."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from nemo_wrap.models.common.parallelize import decoder_tensor_parallel_plan

__all__ = ["tensor_parallel_plan"]


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """Plan for ``parallelize_module(model, tp_mesh, plan)``; see :mod:`nemo_wrap.models.common.parallelize`."""
    return decoder_tensor_parallel_plan()

