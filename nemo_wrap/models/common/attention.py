"""Self-attention with one fused q/k/v projection, run through PyTorch's SDPA kernel."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from nemo_wrap.distributed.context_parallel import active_split, attend_across_split
from nemo_wrap.models.common.layouts import QKVLayout
from nemo_wrap.models.common.rope import apply_rotary


class FusedAttention(nn.Module):
    """Grouped-query attention whose ``qkv_proj`` uses the kv-head-grouped :class:`QKVLayout`.

    Nothing here depends on the global head counts except through the layout's per-group sizes:
    the number of heads a forward computes is read from the width of ``qkv_proj``'s output, so the
    same module runs whole (one process) or on its ``Shard(0)`` chunk under tensor parallelism.
    """

    def __init__(self, config: PreTrainedConfig, layer_idx: int, *, qkv_bias: bool, output_bias: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layout = QKVLayout.from_config(config)
        self.head_dim = self.layout.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.qkv_proj = nn.Linear(config.hidden_size, self.layout.rows, bias=qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=output_bias)

    def _normalize_heads(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head transform of ``(batch, seq, heads, head_dim)`` q/k before RoPE; none by default."""
        return query, key

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        batch, seq = hidden_states.shape[:2]
        query, key, value = self.layout.split_heads(self.qkv_proj(hidden_states))
        query, key = self._normalize_heads(query, key)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        query, key = apply_rotary(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        split = active_split()
        if split is not None:  # context parallel: this rank's queries over every rank's keys
            dropout = self.attention_dropout if self.training else 0.0
            attention = attend_across_split(split, query, key, value, self.scaling, dropout)
            return self.o_proj(attention.transpose(1, 2).reshape(batch, seq, -1))
        # transformers' mask builders return None exactly when the mask is plain causal over equal
        # query and key lengths (or a single query token), which SDPA expresses with is_causal.
        attention = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=attention_mask is None and seq > 1,
            scale=self.scaling,
            enable_gqa=self.layout.heads_per_group > 1,
        )
        return self.o_proj(attention.transpose(1, 2).reshape(batch, seq, -1))
