"""Tensor parallelism for ``NeMoLlamaForCausalLM``: the shared decoder plan as is."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from nemo_wrap.models.common.parallelize import (
    apply_tensor_parallel,
    check_tensor_parallel_compatible,
    decoder_tensor_parallel_plan,
)
from nemo_wrap.models.llama.model import NeMoLlamaForCausalLM

__all__ = ["check_tensor_parallel_compatible", "parallelize_llama", "tensor_parallel_plan"]


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """Plan for ``parallelize_module(model, tp_mesh, plan)``; see :mod:`nemo_wrap.models.common.parallelize`."""
    return decoder_tensor_parallel_plan()


def parallelize_llama(model: NeMoLlamaForCausalLM, tp_mesh: DeviceMesh) -> NeMoLlamaForCausalLM:
    """Apply :func:`tensor_parallel_plan` over ``tp_mesh`` in place (tie restored); returns ``model``."""
    return apply_tensor_parallel(model, tp_mesh, tensor_parallel_plan())
