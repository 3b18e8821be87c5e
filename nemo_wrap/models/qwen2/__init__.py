"""Qwen2 with fused projections: model, checkpoint adapter, tensor-parallel plan."""

from nemo_wrap.models.qwen2.model import NeMoQwen2ForCausalLM
from nemo_wrap.models.qwen2.parallelize import tensor_parallel_plan
from nemo_wrap.models.qwen2.state_dict_adapter import Qwen2StateDictAdapter

__all__ = [
    "NeMoQwen2ForCausalLM",
    "Qwen2StateDictAdapter",
    "tensor_parallel_plan",
]
