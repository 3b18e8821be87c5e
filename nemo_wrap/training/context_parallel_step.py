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
import torch.nn.functional as F
from torch import nn

from nemo_wrap.distributed.context_parallel import SequenceSplit

IGNORE_INDEX = -100


def _local_logits(model: Any, split: SequenceSplit) -> torch.Tensor:
    logits = model(input_ids=split.input_ids, position_ids=split.position_ids).logits
    split.require_attention_calls(type(model).__name__)
    return logits


def context_parallel_backward(
    model: nn.Module, batch: dict[str, torch.Tensor], label_tokens: int, scale: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """Forward this rank's part of ``batch``, back-propagate ``loss · scale``; return the loss."""
    causal_lm: Any = model
    split = SequenceSplit.of(batch, group)
    with split.active():
        logits = _local_logits(causal_lm, split)
        loss = causal_lm.loss_function(
            logits=logits,
            labels=None,
            shift_labels=split.shift_labels,
            vocab_size=causal_lm.config.vocab_size,
            num_items_in_batch=label_tokens,
        )
        (loss * scale).backward()
    return loss.detach()


def context_parallel_eval_totals(
    model: nn.Module, batch: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> torch.Tensor:
    """(token-loss sum, label tokens) of this rank's part of ``batch``."""
    split = SequenceSplit.of(batch, group)
    with split.active():
        logits = _local_logits(model, split)
    labels = split.shift_labels
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return torch.tensor([float(loss), float((labels != IGNORE_INDEX).sum())], dtype=torch.float64)
