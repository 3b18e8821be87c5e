"""Llama with fused projections: model, checkpoint adapter, tensor-parallel plan."""

from nemo_wrap.models.llama.model import NeMoLlamaForCausalLM
from nemo_wrap.models.llama.parallelize import check_tensor_parallel_compatible, parallelize_llama, tensor_parallel_plan
from nemo_wrap.models.llama.state_dict_adapter import LlamaStateDictAdapter

__all__ = [
    "LlamaStateDictAdapter",
    "NeMoLlamaForCausalLM",
    "check_tensor_parallel_compatible",
    "parallelize_llama",
    "tensor_parallel_plan",
]
