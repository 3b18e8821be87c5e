"""One micro-batch's forward and backward, and its evaluation sums, under context parallel.

Every rank of a cp group holds the same micro-batch; each runs the model on its part of every
sequence (:class:`~nemo_wrap.distributed.context_parallel.SequenceSplit`: labels shifted before the
cut, global positions) with the split active, so attention spans the whole sequence. The loss is
the rank's part's over its pre-shifted labels (``shift_labels``) — chunked in the forward where
the load plan says so, else transformers' causal-LM loss of its logits — divided by the step's
global label-token count: the cp ranks' losses add up to the sequence's. The split stays
active through the backward, so activation checkpointing recomputes attention across the parts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_wrap.distributed.context_parallel import SequenceSplit
from nemo_wrap.loading.model_state import loss_plan_of
from nemo_wrap.loading.plan import LossPath
from nemo_wrap.training.linear_loss import chunked_output, cross_entropy_of, loss_context
from nemo_wrap.training.token_loss import IGNORE_INDEX, causal_lm_loss


def _local_loss_sum(model: Any, split: SequenceSplit, num_items_in_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part's loss over ``num_items_in_batch`` and its label tokens, on the load plan's
    path: chunked in the model's forward (its own pre-shifted labels), or from its whole logits."""
    plan, label_tokens = loss_plan_of(model), (split.shift_labels != IGNORE_INDEX).sum()
    if plan.path is LossPath.CHUNKED:
        inputs = {"input_ids": split.input_ids, "position_ids": split.position_ids, "use_cache": False}
        with loss_context(model):
            loss = cross_entropy_of(model, chunked_output(model, inputs, split.shift_labels, num_items_in_batch, plan))
    else:
        logits = model(input_ids=split.input_ids, position_ids=split.position_ids, use_cache=False).logits
        loss = causal_lm_loss(model, logits, num_items_in_batch, shift_labels=split.shift_labels)
    split.require_attention_calls(type(model).__name__)
    return loss, label_tokens


def context_parallel_backward(
    model: nn.Module, batch: dict[str, torch.Tensor], label_tokens: int, scale: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """Forward this rank's part of ``batch``, back-propagate ``loss · scale``; return the loss."""
    split = SequenceSplit.of(batch, group)
    with split.active():
        loss = _local_loss_sum(model, split, label_tokens)[0]
        (loss * scale).backward()
    return loss.detach()


def context_parallel_eval_totals(
    model: nn.Module, batch: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> torch.Tensor:
    """(token-loss sum, label tokens) of this rank's part of ``batch``."""
    split = SequenceSplit.of(batch, group)
    with split.active():
        summed, label_tokens = _local_loss_sum(model, split, 1)  # one "item": the sum
    return torch.tensor([float(summed), float(label_tokens)], dtype=torch.float64)
