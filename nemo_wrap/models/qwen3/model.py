"""``NeMoQwen3ForCausalLM``: Llama's decoder with an RMSNorm over each q and k head before RoPE."""

from __future__ import annotations

from typing import cast

import torch
from transformers import PreTrainedConfig, Qwen3Config

from nemo_wrap.initialization import NeMoPreTrainedModel
from nemo_wrap.models.common.attention import FusedAttention
from nemo_wrap.models.common.causal_lm import NeMoCausalLM
from nemo_wrap.models.common.mlp import GatedMLP
from nemo_wrap.models.common.norm import RMSNorm


class QKNormAttention(FusedAttention):
    """Qwen3 attention: ``q_norm``/``k_norm`` (weights of size ``head_dim``) normalize every head.

    As in transformers' ``Qwen3Attention``, the norms act on ``(batch, seq, heads, head_dim)``
    right after the projection, before the heads are transposed and rotated. Being per head, they
    work unchanged on a rank's local heads under tensor parallelism.
    """

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx, qkv_bias=config.attention_bias, output_bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _normalize_heads(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


# ``NeMoPreTrainedModel`` first: its seeded, sharding-independent weight init overrides transformers'.
class NeMoQwen3ForCausalLM(NeMoPreTrainedModel, NeMoCausalLM):
    """Drop-in for ``Qwen3ForCausalLM`` (``config.head_dim`` may differ from ``hidden_size // heads``)."""

    config_class = Qwen3Config
    hf_architecture = "Qwen3ForCausalLM"

    # ``config`` is a ``Qwen3Config`` (``config_class``); the base class takes any ``PreTrainedConfig``.
    @classmethod
    def _build_attention(cls, config: PreTrainedConfig, layer_idx: int) -> QKNormAttention:
        return QKNormAttention(cast(Qwen3Config, config), layer_idx)

    @classmethod
    def _build_mlp(cls, config: PreTrainedConfig) -> GatedMLP:
        qwen3_config = cast(Qwen3Config, config)
        return GatedMLP(qwen3_config.hidden_size, qwen3_config.intermediate_size, qwen3_config.hidden_act, bias=False)
