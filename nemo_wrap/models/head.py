"""What a family's causal-LM forward does between its backbone and its loss.

The chunked loss (:mod:`nemo_wrap.training.linear_loss`) projects the final hidden states through
the head itself, a chunk of tokens at a time, so it must do exactly what the family's forward does
to them: the head's matmul, then (Gemma 2 and 3) soft-capping of the logits. A family is listed
only once a test has compared its chunked loss and gradients with the full path
(``tests/training/test_linear_loss.py``); any other is trained on its full logits, and the load
plan says why. Granite is left out on purpose: its forward projects every position whatever
``logits_to_keep`` asks, and divides the logits by ``logits_scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# model_type of the families whose forward is ``lm_head(hidden[:, logits_to_keep])``, then the loss
# (soft-capped where the config says so); checked against the full path family by family.
CHUNKABLE_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "starcoder2",
        "gpt_neox",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
        "olmoe",
        "deepseek_v3",
    }
)


@dataclass(frozen=True)
class HeadTransform:
    """The family's logit transform after the head's matmul: ``cap · tanh(logits / cap)`` where it
    soft-caps (Gemma 2 and 3: ``final_logit_softcapping``), else nothing."""

    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def apply_(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The transform in place, for a loss that writes out its own gradient; returns the
        transform's derivative at ``logits`` (``1 − tanh²``), or ``None`` where it is the identity."""
        if self.softcap is None:
            return None
        tanh = logits.div_(self.softcap).tanh_()
        slope = tanh.square().neg_().add_(1.0)
        tanh.mul_(self.softcap)
        return slope

    def describe(self) -> str:
        return "" if self.softcap is None else f", logits soft-capped at {self.softcap:g} as the family does"


def head_transform(config: PretrainedConfig) -> HeadTransform | None:
    """The transform for ``config``'s family, or ``None`` where the chunked loss is not verified."""
    text = config.get_text_config()
    if text.model_type not in CHUNKABLE_FAMILIES:
        return None
    return HeadTransform(getattr(text, "final_logit_softcapping", None))
