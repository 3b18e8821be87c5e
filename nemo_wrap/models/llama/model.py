"""``NeMoLlamaForCausalLM``: transformers' Llama with fused q/k/v and gate/up projections."""

from __future__ import annotations

from transformers import LlamaConfig

from nemo_wrap.initialization import NeMoPreTrainedModel
from nemo_wrap.models.common.attention import FusedAttention
from nemo_wrap.models.common.causal_lm import NeMoCausalLM
from nemo_wrap.models.common.mlp import GatedMLP


# ``NeMoPreTrainedModel`` first: its seeded, sharding-independent weight init overrides transformers'.
class NeMoLlamaForCausalLM(NeMoPreTrainedModel, NeMoCausalLM):
    """Drop-in for ``LlamaForCausalLM`` (same config, checkpoints, outputs and ``generate``)."""

    config_class = LlamaConfig
    hf_architecture = "LlamaForCausalLM"

    @classmethod
    def _build_attention(cls, config: LlamaConfig, layer_idx: int) -> FusedAttention:
        return FusedAttention(config, layer_idx, qkv_bias=config.attention_bias, output_bias=config.attention_bias)

    @classmethod
    def _build_mlp(cls, config: LlamaConfig) -> GatedMLP:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)
