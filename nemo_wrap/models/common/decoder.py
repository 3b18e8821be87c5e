"""The decoder stack shared by Llama, Qwen2 and Qwen3: pre-norm residual blocks over RoPE attention.

The architectures differ only inside the attention and MLP blocks, so the stack takes factories
for those two and is otherwise written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer

from nemo_wrap.distributed.context_parallel import active_split
from nemo_wrap.errors import InvalidModelInputError, UnsupportedModelConfigError
from nemo_wrap.models.common.norm import RMSNorm
from nemo_wrap.models.common.rope import RotaryEmbedding

AttentionFactory = Callable[[PreTrainedConfig, int], nn.Module]


class DecoderOutput(NamedTuple):
    """What the decoder stack returns to the causal-LM head."""

    last_hidden_state: torch.Tensor
    cache: Cache | None
    hidden_states: tuple[torch.Tensor, ...] | None


MLPFactory = Callable[[PreTrainedConfig], nn.Module]

_MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


class DecoderLayer(GradientCheckpointingLayer):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Deriving from transformers' ``GradientCheckpointingLayer`` lets
    ``model.activation_checkpointing_enable()`` checkpoint each layer; ``hidden_states`` is
    positional for that reason (re-entrant checkpointing only tracks positional inputs).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm; returns the last hidden states.

    Attention masks come from transformers' own builders (``create_causal_mask`` and, for Qwen
    layers with a sliding window, ``create_sliding_window_causal_mask``), so padding, KV-cache
    offsets and windowing match transformers' models exactly.
    """

    def __init__(self, config: PreTrainedConfig, build_attention: AttentionFactory, build_mlp: MLPFactory) -> None:
        super().__init__()
        self.config = config
        self.layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        unsupported = sorted(set(self.layer_types) - set(_MASK_BUILDERS))
        if unsupported:
            raise UnsupportedModelConfigError(
                f"layer_types contains {unsupported}; supported layer types are {sorted(_MASK_BUILDERS)}"
            )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            DecoderLayer(build_attention(config, index), build_mlp(config), config.hidden_size, config.rms_norm_eps)
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool | None = False,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
    ) -> DecoderOutput:
        """The last hidden state, the cache (created here when ``use_cache`` asks for one), and with
        ``output_hidden_states`` every layer's input plus the final normed state, as transformers
        returns them (``num_hidden_layers + 1`` tensors).

        ``attention_mask`` is the usual 2-D padding mask, or a ``{layer_type: mask}`` dict already
        built by ``generate`` (it does so for compileable caches). ``output_attentions`` and
        ``return_dict`` are taken as transformers' backbones take them, because callers that run
        the backbone alone pass them (TRL's fused LM head, under PEFT): the output is always a
        named tuple, and attention weights are never computed, so ``output_attentions=True`` raises.
        """
        refuse_attention_weights(output_attentions, type(self).__name__)
        if (input_ids is None) == (inputs_embeds is None):
            raise InvalidModelInputError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
        masks = self._attention_masks(attention_mask, inputs_embeds, cache, position_ids)
        position_embeddings = self.rotary_emb(position_ids, inputs_embeds.dtype)
        hidden_states = inputs_embeds
        layer_inputs = []
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            layer_inputs.append(hidden_states)
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[layer_type],
                position_embeddings=position_embeddings,
                cache=cache,
            )
        last = self.norm(hidden_states)
        if not output_hidden_states:
            return DecoderOutput(last, cache, None)
        return DecoderOutput(last, cache, (*(_whole(state) for state in layer_inputs), last))

    def _attention_masks(
        self,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None,
        inputs_embeds: torch.Tensor,
        cache: Cache | None,
        position_ids: torch.Tensor,
    ) -> dict[str, torch.Tensor | None]:
        """One mask per layer type, from transformers' own builders (or as ``generate`` built them);
        none under context parallel, whose split makes its own over every rank's keys."""
        if isinstance(attention_mask, dict):
            return dict(attention_mask)
        if active_split() is not None:
            return dict.fromkeys(self.layer_types, None)
        return {
            layer_type: _MASK_BUILDERS[layer_type](
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )
            for layer_type in set(self.layer_types)
        }


def _whole(hidden_states: torch.Tensor) -> torch.Tensor:
    """A layer's input as the caller sees it: under sequence parallel the stream between layers
    is a DTensor cut along the sequence, gathered here (differentiably) into a plain tensor."""
    return hidden_states.full_tensor() if isinstance(hidden_states, DTensor) else hidden_states


def refuse_attention_weights(output_attentions: bool | None, model_name: str) -> None:
    """SDPA computes no attention weights: asking for them raises, naming the way to get them."""
    if output_attentions:
        raise InvalidModelInputError(
            f"{model_name} runs attention through PyTorch's SDPA kernel, which computes no "
            "attention weights: load with force_hf=True and attn_implementation='eager' to get them"
        )
