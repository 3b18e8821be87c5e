"""``NeMoQwen2ForCausalLM``: Llama's decoder with biased q/k/v projections (and an unbiased ``o_proj``)."""

from __future__ import annotations

from transformers import Qwen2Config

from nemo_wrap.initialization import NeMoPreTrainedModel
from nemo_wrap.models.common.attention import FusedAttention
from nemo_wrap.models.common.causal_lm import NeMoCausalLM
from nemo_wrap.models.common.mlp import GatedMLP


# ``NeMoPreTrainedModel`` first: its seeded, sharding-independent weight init overrides transformers'.
class NeMoQwen2ForCausalLM(NeMoPreTrainedModel, NeMoCausalLM):
    """Drop-in for ``Qwen2ForCausalLM``, including sliding-window layers (via transformers' masks)."""

    config_class = Qwen2Config
    hf_architecture = "Qwen2ForCausalLM"

    @classmethod
    def _build_attention(cls, config: Qwen2Config, layer_idx: int) -> FusedAttention:
        return FusedAttention(config, layer_idx, qkv_bias=True, output_bias=False)

    @classmethod
    def _build_mlp(cls, config: Qwen2Config) -> GatedMLP:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=False)
