"""``NeMoLlamaForCausalLM``: transformers' Llama with fused q/k/v and gate/up projections."""

from __future__ import annotations

from typing import cast

from transformers import LlamaConfig, PreTrainedConfig

from nemo_wrap.initialization import NeMoPreTrainedModel
from nemo_wrap.models.common.attention import FusedAttention
from nemo_wrap.models.common.causal_lm import NeMoCausalLM
from nemo_wrap.models.common.mlp import GatedMLP


# ``NeMoPreTrainedModel`` first: its seeded, sharding-independent weight init overrides transformers'.
class NeMoLlamaForCausalLM(NeMoPreTrainedModel, NeMoCausalLM):
    """Drop-in for ``LlamaForCausalLM`` (same config, checkpoints, outputs and ``generate``)."""

    config_class = LlamaConfig
    hf_architecture = "LlamaForCausalLM"

    # ``config`` is a ``LlamaConfig`` (``config_class``); the base class takes any ``PreTrainedConfig``.
    @classmethod
    def _build_attention(cls, config: PreTrainedConfig, layer_idx: int) -> FusedAttention:
        llama_config = cast(LlamaConfig, config)
        bias = llama_config.attention_bias
        return FusedAttention(llama_config, layer_idx, qkv_bias=bias, output_bias=bias)

    @classmethod
    def _build_mlp(cls, config: PreTrainedConfig) -> GatedMLP:
        llama_config = cast(LlamaConfig, config)
        return GatedMLP(
            llama_config.hidden_size,
            llama_config.intermediate_size,
            llama_config.hidden_act,
            bias=llama_config.mlp_bias,
        )
