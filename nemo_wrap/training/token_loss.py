"""The causal-LM loss pieces every step and evaluation shares: transformers' loss with a global
token count, and the (token-loss sum, label tokens) totals an evaluation adds up over ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss(
    model: Any,
    logits: torch.Tensor,
    num_items_in_batch: int,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' causal-LM loss of ``model`` (it shifts ``labels``; ``shift_labels`` are
    already shifted), summed over tokens and divided by the step's global label count."""
    return model.loss_function(
        logits=logits,
        labels=labels,
        shift_labels=shift_labels,
        vocab_size=model.config.vocab_size,
        num_items_in_batch=num_items_in_batch,
    )


def token_loss_totals(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """(token-loss sum, label tokens) of ``logits`` against already shifted labels, in float64.

    ``reduction="sum"``: a batch with no label token adds zero instead of transformers' 0/0.
    """
    loss = F.cross_entropy(
        logits.flatten(0, -2).float(), shift_labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return torch.tensor([float(loss), float((shift_labels != IGNORE_INDEX).sum())], dtype=torch.float64)
