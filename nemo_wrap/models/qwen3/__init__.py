"""Qwen3 with fused projections: model, checkpoint adapter, tensor-parallel plan."""

from nemo_wrap.models.qwen3.model import NeMoQwen3ForCausalLM
from nemo_wrap.models.qwen3.parallelize import tensor_parallel_plan
from nemo_wrap.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

__all__ = [
    "NeMoQwen3ForCausalLM",
    "Qwen3StateDictAdapter",
    "tensor_parallel_plan",
]
