"""Qwen2 with fused q/k/v (biased) and gate/up projections: the model and its spec."""

from nemo_wrap.models.common.parallelize import fused_decoder_plan, fused_decoder_sequence_parallel_plan
from nemo_wrap.models.common.state_dict_adapter import FusedStateDictAdapter
from nemo_wrap.models.qwen2.model import NeMoQwen2ForCausalLM
from nemo_wrap.models.spec import ModelSpec

SPEC = ModelSpec(
    architectures=("Qwen2ForCausalLM",),
    model_class=NeMoQwen2ForCausalLM,
    state_dict_adapter=FusedStateDictAdapter,
    tensor_parallel_plan=fused_decoder_plan,
    sequence_parallel_plan=fused_decoder_sequence_parallel_plan,
)

__all__ = ["SPEC", "NeMoQwen2ForCausalLM"]
