"""Llama with fused projections: model, checkpoint adapter, tensor-parallel plan."""

from nemo_wrap.models.llama.model import NeMoLlamaForCausalLM
from nemo_wrap.models.llama.parallelize import tensor_parallel_plan
from nemo_wrap.models.llama.state_dict_adapter import LlamaStateDictAdapter

__all__ = [
    "LlamaStateDictAdapter",
    "NeMoLlamaForCausalLM",
    "tensor_parallel_plan",
]
