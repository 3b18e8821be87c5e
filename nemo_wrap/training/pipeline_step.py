"""A training step and an evaluation over pipeline stages, driven by torch's schedule.

The caller's micro-batches are the pipeline's micro-batches: they are stacked into one batch (right-
padded to one length, the padding ignored by the loss) that torch's schedule splits back into them.
The last stage's loss is the step's loss path (the load plan's): on the full path its output is the
logits and the schedule's loss function transformers' causal-LM loss; on the chunked path its
forward computes :func:`~nemo_wrap.training.linear_loss.linear_cross_entropy_sum` of its final
hidden states itself (its labels travel as a forward input; the stage module says why the forward)
and outputs that sum. Either is divided by the step's global label-token count
(``num_items_in_batch``) and multiplied by the data-parallel degree, as in the one-stage step, so
the loss and gradients equal one process's. After the schedule, a tied embedding's two copies
(first and last stage) get the sum of their gradients, and the clipping norm is taken over every
stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.distributed.pipeline.layout import PipelineSchedule
from nemo_wrap.distributed.pipeline.runtime import PipelineRuntime
from nemo_wrap.distributed.pipeline.stage_model import HeadLoss
from nemo_wrap.errors import InvalidModelInputError, InvalidSetupError
from nemo_wrap.initialization.geometry import local_shard
from nemo_wrap.loading.model_state import loss_plan_of
from nemo_wrap.loading.plan import LossPath
from nemo_wrap.training.clipping import gradient_norm, scale_gradients_
from nemo_wrap.training.linear_loss import loss_context, planned_cross_entropy, shifted_labels
from nemo_wrap.training.token_loss import IGNORE_INDEX, causal_lm_loss, token_loss_totals

_PADDING = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}


def check_micro_batch_count(runtime: PipelineRuntime, count: int) -> None:
    """1F1B needs at least one micro-batch per stage: refused before any collective."""
    stages = runtime.layout.stages
    if runtime.schedule is PipelineSchedule.ONE_F_ONE_B and count < stages:
        raise InvalidSetupError(
            f"train_step: {count} micro-batch(es) with pp_schedule='1f1b' over pp_size={stages} stages; 1F1B needs "
            f"at least {stages} (pass more micro-batches, or build the setup with pp_schedule='gpipe')"
        )


def pipeline_forward_backward(
    model: nn.Module,
    runtime: PipelineRuntime,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    label_tokens: int,
    dp_size: int,
) -> torch.Tensor:
    """Run the schedule over ``micro_batches``; return this pipeline's loss sum on every stage."""
    stacked = stack_micro_batches(micro_batches)
    layout = runtime.layout
    head_loss, loss_inputs = _head_loss_inputs(model, runtime, stacked)

    def loss_fn(output: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int) -> torch.Tensor:
        # times dp: undoes the data-parallel gradient averaging, as the one-stage step does
        if head_loss is not None:  # the last stage's output is its chunked loss sum
            return output.sum() / num_items_in_batch * dp_size
        return causal_lm_loss(model, output, num_items_in_batch, labels=labels) * dp_size

    rows = micro_batches[0]["input_ids"].shape[0]
    schedule = runtime.schedule_for((rows, stacked["input_ids"].shape[1]), len(micro_batches), loss_fn)
    losses: list[torch.Tensor] = []
    with runtime.module.driven(head_loss), loss_context(model):
        schedule.step(
            *((stacked["input_ids"],) if layout.is_first else ()),
            target=stacked["labels"] if layout.is_last else None,
            losses=losses if layout.is_last else None,
            loss_kwargs={"num_items_in_batch": label_tokens},
            return_outputs=False,
            **_side_inputs(stacked),
            **loss_inputs,
        )
    sum_tied_gradients(model, runtime)
    local = sum(loss.detach().float().cpu() for loss in losses) / dp_size if losses else torch.zeros(())
    return _from_last_stage(torch.as_tensor(local, dtype=torch.float32), runtime)


def _head_loss_inputs(
    model: nn.Module, runtime: PipelineRuntime, stacked: Mapping[str, torch.Tensor]
) -> tuple[HeadLoss | None, dict[str, Any]]:
    """On the chunked path, the head loss the last stage computes in its forward and the labels
    it takes as a forward input (the schedule splits them with the micro-batches); nothing on the
    full path, whose last stage outputs the logits."""
    plan = loss_plan_of(model)
    if plan.path is not LossPath.CHUNKED:
        return None, {}
    cross_entropy = planned_cross_entropy(plan)

    def head_loss(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weight = cast(Any, model).get_output_embeddings().weight  # read in the stage's forward: gathered
        return cross_entropy(hidden, weight, shifted_labels(labels)).reshape(1)  # the schedule concatenates

    return head_loss, ({"labels": stacked["labels"]} if runtime.layout.is_last else {})


def stack_micro_batches(micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch of the micro-batches, each right-padded to the longest (padding is never a label)."""
    rows = {batch["input_ids"].shape[0] for batch in micro_batches}
    if len(rows) > 1:
        raise InvalidModelInputError(
            f"train_step: pipeline micro-batches must have the same number of rows, got {sorted(rows)}"
        )
    length = max(batch["input_ids"].shape[1] for batch in micro_batches)
    keys = {"input_ids", "labels"} | {
        k for k in ("attention_mask", "position_ids") if any(k in b for b in micro_batches)
    }
    padded = [_padded(batch, keys, length) for batch in micro_batches]
    return {key: torch.cat([batch[key] for batch in padded]) for key in keys}


def _padded(batch: Mapping[str, torch.Tensor], keys: set[str], length: int) -> dict[str, torch.Tensor]:
    ids = batch["input_ids"]
    rows, width = ids.shape
    defaults = {
        "labels": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(width).expand(rows, width),
    }
    out = {}
    for key in keys:
        value = batch[key] if key in batch else defaults[key]
        if key == "position_ids":
            extra = value[:, -1:] + torch.arange(1, length - width + 1)  # positions go on past the end
        else:
            extra = torch.full((rows, length - width), _PADDING[key], dtype=value.dtype)
        out[key] = torch.cat([value, extra.to(value.dtype)], dim=1)
    return out


def _side_inputs(stacked: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What every stage takes besides the activations (torch's schedule splits it per micro-batch)."""
    return {key: stacked[key] for key in ("position_ids", "attention_mask") if key in stacked}


def _from_last_stage(value: torch.Tensor, runtime: PipelineRuntime) -> torch.Tensor:
    """The last stage's ``value`` on every stage of this pipeline (the others hold zeros)."""
    dist.all_reduce(value, group=runtime.group)
    return value


def sum_tied_gradients(model: nn.Module, runtime: PipelineRuntime) -> None:
    """Give both copies of a tied embedding (first and last stage) the sum of their gradients."""
    if runtime.tie_group is None:
        return
    weight = cast(Any, model).get_input_embeddings().weight
    if weight.grad is None:
        return
    if isinstance(weight, DTensor) and tuple(weight.grad.placements) != tuple(weight.placements):
        # a vocab-parallel embedding's gradient may come back replicated: lay it out as the weight is
        weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
    dist.all_reduce(local_shard(weight.grad), group=runtime.tie_group)


def pipeline_clip_grad_norm_(model: nn.Module, runtime: PipelineRuntime, max_norm: float) -> torch.Tensor:
    """Clip by the norm over every stage's gradients, a tied embedding counted once."""
    counted_on_first_stage = runtime.tie_group is not None and not runtime.layout.is_first
    duplicate = cast(Any, model).get_input_embeddings().weight if counted_on_first_stage else None
    gradients = [p.grad for p in model.parameters() if p.grad is not None and p is not duplicate]
    squared = gradient_norm(gradients).detach().float().cpu() ** 2
    dist.all_reduce(squared, group=runtime.group)
    total = squared.sqrt()
    scale_gradients_([p.grad for p in model.parameters() if p.grad is not None], total, max_norm)
    return total


def pipeline_evaluate_totals(
    model: nn.Module, runtime: PipelineRuntime, batch: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """(loss sum, label tokens) of one batch, forward-only through the stages, on every stage."""
    stacked = stack_micro_batches([batch])
    schedule = runtime.schedule_for(tuple(stacked["input_ids"].shape), 1, None)
    head_loss, loss_inputs = _head_loss_inputs(model, runtime, stacked)
    first = (stacked["input_ids"],) if runtime.layout.is_first else ()
    with runtime.module.driven(head_loss), loss_context(model), torch.no_grad():
        output = schedule.step(*first, **_side_inputs(stacked), **loss_inputs)
    totals = torch.zeros(2, dtype=torch.float64)
    if runtime.layout.is_last and head_loss is not None:  # the chunked loss sum
        tokens = (stacked["labels"][..., 1:] != IGNORE_INDEX).sum()
        totals += torch.tensor([float(output.sum()), float(tokens)], dtype=torch.float64)
    elif runtime.layout.is_last:
        totals += token_loss_totals(output[..., :-1, :], stacked["labels"][..., 1:])
    dist.all_reduce(totals, group=runtime.group)
    return totals
