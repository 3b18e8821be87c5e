"""``NeMoCausalLM``: the transformers-facing base of our fused Llama-family causal LMs.

It is a real transformers ``PreTrainedModel`` + ``GenerationMixin``, so ``generate()``, gradient
checkpointing, weight init and tying work as for transformers' own classes. What it adds is the
checkpoint boundary: parameters are stored fused, and checkpoints are read and written in
transformers' unfused format through :class:`FusedStateDictAdapter`, which each architecture's
spec names (``nemo_wrap/models/<arch>/__init__.py``), so a model saved by nemo_wrap loads with
plain ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel, initialization
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from nemo_wrap.models.common.decoder import DecoderModel, refuse_attention_weights
from nemo_wrap.models.common.norm import RMSNorm
from nemo_wrap.models.common.rope import RotaryEmbedding, rope_inverse_frequencies


class NeMoCausalLM(PreTrainedModel, GenerationMixin):
    """Decoder-only LM: ``model`` (:class:`DecoderModel`) then ``lm_head``.

    Subclasses set ``config_class`` and ``hf_architecture`` (the transformers class name written
    to ``config.architectures``), and build their attention and MLP in
    :meth:`_build_attention` / :meth:`_build_mlp`.
    """

    hf_architecture: ClassVar[str]

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # transformers declares the next two as instance attributes (``post_init`` reassigns
    # ``_no_split_modules`` on the instance), so a ``ClassVar`` annotation would contradict the base class.
    _no_split_modules = ["DecoderLayer"]  # noqa: RUF012
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__(config)
        self.model = DecoderModel(config, self._build_attention, self._build_mlp)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _build_attention(cls, config: PreTrainedConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError(f"{cls.__name__} must build its attention block")

    @classmethod
    def _build_mlp(cls, config: PreTrainedConfig) -> nn.Module:
        raise NotImplementedError(f"{cls.__name__} must build its MLP block")

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' rule, plus our norm (ones) and rotary buffer (recomputed from the config).

        transformers recognizes norms and rotary modules by class-name substrings; matching our
        own classes explicitly keeps the rule independent of naming.
        """
        if isinstance(module, RMSNorm):
            initialization.ones_(module.weight)
        elif isinstance(module, RotaryEmbedding):
            initialization.copy_(module.inv_freq, rope_inverse_frequencies(self.config))
        else:
            super()._init_weights(module)

    def get_decoder(self) -> nn.Module:
        """The backbone (``model``): transformers' lookup would find no decoder in our own classes."""
        return self.model

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **loss_kwargs,
    ) -> CausalLMOutputWithPast:
        """Same inputs and outputs as transformers' ``LlamaForCausalLM.forward``.

        ``use_cache`` defaults to ``config.use_cache`` (off while training with activation
        checkpointing, as in transformers). ``output_hidden_states`` returns transformers' tuple of
        ``num_hidden_layers + 1`` states. Attention weights are never computed (SDPA), so
        ``output_attentions=True`` raises. ``loss_kwargs`` (e.g. ``num_items_in_batch``) go to
        transformers' causal-LM loss, which shifts ``labels`` itself; the output is always a
        ``CausalLMOutputWithPast``, so ``return_dict`` (which ``generate`` passes) has no effect.
        """
        refuse_attention_weights(output_attentions, type(self).__name__)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.training and torch.is_grad_enabled() and self.is_activation_checkpointing:
            use_cache = False  # the checkpointed layers drop the cache anyway; do not create one
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        decoded = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        logits = self.lm_head(slice_logits_to_keep(decoded.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=decoded.cache, hidden_states=decoded.hidden_states
        )
