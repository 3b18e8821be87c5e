"""One micro-batch's forward and backward, and its evaluation sums, under context parallel.

Every rank of a cp group holds the same micro-batch; each runs the model on its part of every
sequence (:class:`~nemo_wrap.distributed.context_parallel.SequenceSplit`: labels shifted before the
cut, global positions) with the split active, so attention spans the whole sequence. The loss is
transformers' causal-LM loss over the rank's pre-shifted labels (``shift_labels``), divided by the
step's global label-token count: the cp ranks' losses add up to the sequence's. The split stays
active through the backward, so activation checkpointing recomputes attention across the parts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_wrap.distributed.context_parallel import SequenceSplit
from nemo_wrap.training.token_loss import causal_lm_loss, token_loss_totals


def _local_logits(model: Any, split: SequenceSplit) -> torch.Tensor:
    logits = model(input_ids=split.input_ids, position_ids=split.position_ids).logits
    split.require_attention_calls(type(model).__name__)
    return logits


def context_parallel_backward(
    model: nn.Module, batch: dict[str, torch.Tensor], label_tokens: int, scale: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """Forward this rank's part of ``batch``, back-propagate ``loss · scale``; return the loss."""
    split = SequenceSplit.of(batch, group)
    with split.active():
        loss = causal_lm_loss(model, _local_logits(model, split), label_tokens, shift_labels=split.shift_labels)
        (loss * scale).backward()
    return loss.detach()


def context_parallel_eval_totals(
    model: nn.Module, batch: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> torch.Tensor:
    """(token-loss sum, label tokens) of this rank's part of ``batch``."""
    split = SequenceSplit.of(batch, group)
    with split.active():
        logits = _local_logits(model, split)
    return token_loss_totals(logits, split.shift_labels)
