"""Qwen3 with fused projections and per-head q/k norms: the model and its spec.

Under tensor parallel the q/k norms see only a rank's heads, so the spec has their gradients
summed over the tp ranks.
"""

from nemo_wrap.models.common.parallelize import (
    QK_NORM_MODULES,
    fused_decoder_plan,
    fused_decoder_sequence_parallel_plan,
)
from nemo_wrap.models.common.state_dict_adapter import FusedStateDictAdapter
from nemo_wrap.models.qwen3.model import NeMoQwen3ForCausalLM
from nemo_wrap.models.spec import ModelSpec

SPEC = ModelSpec(
    architectures=("Qwen3ForCausalLM",),
    model_class=NeMoQwen3ForCausalLM,
    state_dict_adapter=FusedStateDictAdapter,
    tensor_parallel_plan=fused_decoder_plan,
    sequence_parallel_plan=fused_decoder_sequence_parallel_plan,
    gradient_sum_modules=QK_NORM_MODULES,
)

__all__ = ["SPEC", "NeMoQwen3ForCausalLM"]
