"""One optimizer step whose loss and gradients equal one process's, whatever the strategy.

transformers' in-forward loss averages over the label tokens *of the batch it is given*. Under
data parallel each rank sees a different batch, and gradients are then averaged over ranks: with
unequal token counts per rank that is not the mean over all tokens. So the step counts the label
tokens over every micro-batch and every data-parallel rank first, hands that count to the model as
``num_items_in_batch`` (each micro-batch loss becomes its token-loss sum / global count), and
scales what it back-propagates by the data-parallel degree to undo the managers' gradient
averaging. A plain ``model(input_ids=..., labels=...)`` keeps transformers' per-rank meaning.
An MoE model that adds a load-balancing loss (``output_router_logits=True``) gets that loss of the
whole data-parallel micro-batch too (:mod:`.router_loss`), not each rank's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from nemo_wrap.distributed.combinations import Feature, refuse_unsupported, setup_arguments
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.loading.model_state import loss_plan_of, pipeline_of, setup_of
from nemo_wrap.loading.plan import LossPath, LossPlan
from nemo_wrap.training.accumulation import no_gradient_sync
from nemo_wrap.training.clipping import clip_grad_norm_
from nemo_wrap.training.context_parallel_step import context_parallel_backward
from nemo_wrap.training.linear_loss import chunked_output, cross_entropy_of, loss_context, shifted_labels
from nemo_wrap.training.pipeline_step import (
    check_micro_batch_count,
    pipeline_clip_grad_norm_,
    pipeline_forward_backward,
)
from nemo_wrap.training.router_loss import adds_router_loss, router_loss_share
from nemo_wrap.training.token_loss import IGNORE_INDEX, causal_lm_loss


@dataclass(frozen=True)
class StepResult:
    """What one step did: the global mean loss, the gradient norm before clipping, the token count."""

    loss: float
    grad_norm: float | None
    label_tokens: int


def labels_of(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The batch's ``labels``, or its ``input_ids`` when it has none (transformers shifts them)."""
    return batch["labels"] if "labels" in batch else batch["input_ids"]


def forward_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a step's forward takes besides ``input_ids``: the optional mask and (packed) positions,
    and no cache — with one, transformers stops telling a packed row's examples apart (its masks
    read positions as a continuation), which an eval-mode forward would otherwise make."""
    return {
        "attention_mask": batch.get("attention_mask"),
        "position_ids": batch.get("position_ids"),
        "use_cache": False,
    }


def _count_label_tokens(micro_batches: Sequence[Mapping[str, torch.Tensor]], group) -> int:
    """Tokens that contribute to the loss after transformers' one-position label shift."""
    local = sum(int((labels_of(b)[..., 1:] != IGNORE_INDEX).sum()) for b in micro_batches)
    count = torch.tensor([local], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(count, group=group)
    return int(count.item())


def global_label_tokens(micro_batches: Sequence[Mapping[str, torch.Tensor]], group, caller: str) -> int:
    """The step's label tokens over every micro-batch of every rank of ``group``; none is an error.
    Named in torch's profiler (``nemo_wrap::`` ranges are the step's own bookkeeping)."""
    with record_function("nemo_wrap::count_label_tokens"):
        label_tokens = _count_label_tokens(micro_batches, group)
    if label_tokens == 0:
        raise ValueError(f"{caller}: the micro-batches hold no label token on any rank (all labels are -100)")
    return label_tokens


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    max_grad_norm: float | None = None,
) -> StepResult:
    """Forward/backward every micro-batch (syncing gradients only on the last), clip, step.

    Each batch holds ``input_ids`` and optionally ``labels`` (default: ``input_ids``; ``-100`` is
    ignored), ``attention_mask`` and ``position_ids`` (restarting at each example of a packed row).
    Every rank of the job must call it with its own batches. On a pipelined model the
    micro-batches are the pipeline's (torch's schedule runs them through the stages; every stage of
    a pipeline gets the same batches, as ``setup.dp_rank()`` deals them).
    """
    pipeline = pipeline_of(model)
    if pipeline is not None:
        check_micro_batch_count(pipeline, len(micro_batches))  # before any collective
    setup = setup_of(model)
    _check_router_loss_supported(model, setup)
    label_tokens = global_label_tokens(micro_batches, setup.dp_group(), "train_step")  # counted over dp
    loss_sum, grad_norm = step_with_label_count(model, optimizer, micro_batches, label_tokens, max_grad_norm)
    loss_group = setup.loss_group()
    with record_function("nemo_wrap::reduce_loss"):
        if loss_group is not None:  # every data-parallel rank's tokens (and every cp rank's part of them)
            dist.all_reduce(loss_sum, group=loss_group)
        loss = float(loss_sum)
    return StepResult(loss=loss, grad_norm=grad_norm, label_tokens=label_tokens)


def step_with_label_count(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    label_tokens: int,
    max_grad_norm: float | None,
) -> tuple[torch.Tensor, float | None]:
    """:func:`train_step` once the step's global label count is known: forward/backward every
    micro-batch and update; this rank's loss sum (not yet reduced) and the gradient norm. It reads
    no value back from a tensor unless clipping, so the memory prediction runs it on fake tensors."""
    pipeline, setup = pipeline_of(model), setup_of(model)
    group, cp_group = setup.dp_group(), setup.cp_group()
    dp_size = 1 if group is None else dist.get_world_size(group)
    if pipeline is not None:
        loss_sum = pipeline_forward_backward(model, pipeline, micro_batches, label_tokens, dp_size)
    else:  # the managers average gradients over dp (× cp): scaled back, the step's sum over all tokens
        scale = dp_size * (1 if cp_group is None else dist.get_world_size(cp_group))
        loss_sum = _forward_backward(model, micro_batches, label_tokens, scale, cp_group, setup.loss_group())
    return loss_sum, optimizer_update(model, optimizer, max_grad_norm)


def optimizer_update(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None) -> float | None:
    """Clip the gradients (if ``max_grad_norm``), step and clear them; the norm before clipping."""
    pipeline = pipeline_of(model)
    grad_norm = None
    if max_grad_norm is not None and pipeline is not None:
        grad_norm = float(pipeline_clip_grad_norm_(model, pipeline, max_grad_norm))
    elif max_grad_norm is not None:
        grad_norm = float(clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _forward_backward(
    model: nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    label_tokens: int,
    scale: int,
    cp_group: dist.ProcessGroup | None,
    loss_group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Forward and backward each micro-batch in turn (gradients synced on the last); the loss sum.
    Under context parallel each rank runs its part of every sequence (its losses are partial sums)."""
    loss_sum = torch.zeros(())
    for index, batch in enumerate(micro_batches):
        is_last = index == len(micro_batches) - 1
        with nullcontext() if is_last else no_gradient_sync(model):
            if cp_group is not None:
                loss = context_parallel_backward(model, dict(batch), label_tokens, scale, cp_group)
            else:
                with loss_context(model):
                    loss = _micro_batch_loss(model, batch, label_tokens, loss_group)
                    (loss * scale).backward()
        loss_sum += loss.detach().float().cpu()
    return loss_sum


def _micro_batch_loss(
    model: nn.Module, batch: Mapping[str, torch.Tensor], label_tokens: int, loss_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """transformers' loss of one micro-batch over the step's global label count; for MoE models that
    add a load-balancing loss, that loss of the whole data-parallel micro-batch (this rank's share)."""
    plan = loss_plan_of(model)
    if plan.path is LossPath.CHUNKED:
        return _chunked_micro_batch_loss(model, batch, label_tokens, loss_group, plan)
    if adds_router_loss(model):
        logits, router_loss = logits_and_router_loss(model, batch, loss_group)  # no labels: assembled here
        return causal_lm_loss(model, logits, label_tokens, labels=labels_of(batch)) + router_loss
    return model(
        input_ids=batch["input_ids"],
        **forward_inputs(batch),
        labels=labels_of(batch),
        num_items_in_batch=label_tokens,
    ).loss


def _chunked_micro_batch_loss(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    label_tokens: int,
    loss_group: dist.ProcessGroup | None,
    plan: LossPlan,
) -> torch.Tensor:
    """:func:`_micro_batch_loss` on the chunked path (a load-balancing loss: this rank's share of
    the data-parallel batch's, from the router logits of the same forward)."""
    inputs, shifted = {"input_ids": batch["input_ids"], **forward_inputs(batch)}, shifted_labels(labels_of(batch))
    output = chunked_output(model, inputs, shifted, label_tokens, plan)
    loss = cross_entropy_of(model, output)
    if adds_router_loss(model):
        loss = loss + router_loss_share(model, output.router_logits, inputs["attention_mask"], loss_group)
    return loss


def logits_and_router_loss(
    model: nn.Module, batch: Mapping[str, torch.Tensor], loss_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one micro-batch, and this rank's share of the data-parallel micro-batch's
    load-balancing loss (zero for a model that adds none)."""
    inputs = forward_inputs(batch)
    if not adds_router_loss(model):
        return model(input_ids=batch["input_ids"], **inputs).logits, torch.zeros(())
    outputs = model(input_ids=batch["input_ids"], **inputs, output_router_logits=True)
    return outputs.logits, router_loss_share(model, outputs.router_logits, inputs["attention_mask"], loss_group)


def _check_router_loss_supported(model: nn.Module, setup: DistributedSetup) -> None:
    """A model that adds a load-balancing loss, against the combination table."""
    if adds_router_loss(model):
        router = {Feature.ROUTER_LOSS: f"{type(model).__name__}'s output_router_logits=True"}
        refuse_unsupported("train_step", setup_arguments(setup) | router)
