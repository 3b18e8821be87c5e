"""``NeMoQwen2ForCausalLM``: Llama's decoder with biased q/k/v projections (and an unbiased ``o_proj``)."""

from __future__ import annotations

from typing import cast

from transformers import PreTrainedConfig, Qwen2Config

from nemo_wrap.initialization import NeMoPreTrainedModel
from nemo_wrap.models.common.attention import FusedAttention
from nemo_wrap.models.common.causal_lm import NeMoCausalLM
from nemo_wrap.models.common.mlp import GatedMLP


# ``NeMoPreTrainedModel`` first: its seeded, sharding-independent weight init overrides transformers'.
class NeMoQwen2ForCausalLM(NeMoPreTrainedModel, NeMoCausalLM):
    """Drop-in for ``Qwen2ForCausalLM``, including sliding-window layers (via transformers' masks)."""

    config_class = Qwen2Config
    hf_architecture = "Qwen2ForCausalLM"

    # ``config`` is a ``Qwen2Config`` (``config_class``); the base class takes any ``PreTrainedConfig``.
    @classmethod
    def _build_attention(cls, config: PreTrainedConfig, layer_idx: int) -> FusedAttention:
        return FusedAttention(config, layer_idx, qkv_bias=True, output_bias=False)

    @classmethod
    def _build_mlp(cls, config: PreTrainedConfig) -> GatedMLP:
        qwen2_config = cast(Qwen2Config, config)
        return GatedMLP(qwen2_config.hidden_size, qwen2_config.intermediate_size, qwen2_config.hidden_act, bias=False)
