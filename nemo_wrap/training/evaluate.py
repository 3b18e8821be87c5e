"""Evaluation loss: the mean over every label token of every rank, as one process would compute it.

Each rank sums the token losses of its own batches and counts its tokens; both sums are reduced
over the data-parallel ranks before dividing, so ranks with more tokens weigh more (a mean of
per-rank means would not). The cross-entropy is summed (``reduction="sum"``): a padding batch (no
label token) then adds zero instead of transformers' 0/0. It is the steps' loss path: chunked where
the load plan says so (:mod:`.linear_loss`), else from the whole logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from nemo_wrap.loading.model_state import loss_plan_of, pipeline_of, setup_of
from nemo_wrap.loading.plan import LossPath
from nemo_wrap.training.context_parallel_step import context_parallel_eval_totals
from nemo_wrap.training.linear_loss import chunked_causal_lm_loss, loss_context
from nemo_wrap.training.pipeline_step import pipeline_evaluate_totals
from nemo_wrap.training.token_loss import IGNORE_INDEX, token_loss_totals


def evaluate(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]]) -> float:
    """Token-weighted mean loss of ``model`` over this rank's ``batches`` and every other rank's.

    Every rank of the job calls it with the same number of batches (a sharded forward is collective).
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # loss sum, token count
    setup = setup_of(model)
    try:
        with torch.no_grad():
            for batch in batches:
                totals += _batch_totals(model, batch, setup.cp_group())
    finally:
        model.train(was_training)
    group = setup.loss_group()  # dp (× cp: each cp rank holds a part)
    if group is not None:
        dist.all_reduce(totals, group=group)
    return float(totals[0] / totals[1])


def _batch_totals(
    model: nn.Module, batch: Mapping[str, torch.Tensor], cp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """(token-loss sum, label tokens) of this rank's share of one batch. No cache: with one, an
    eval-mode forward would not tell a packed row's examples apart."""
    pipeline = pipeline_of(model)
    if pipeline is not None:  # forward-only through the stages
        return pipeline_evaluate_totals(model, pipeline, batch)
    if cp_group is not None:  # this rank's part of every sequence
        return context_parallel_eval_totals(model, dict(batch), cp_group)
    plan, inputs = loss_plan_of(model), {"position_ids": batch.get("position_ids"), "use_cache": False}
    if plan.path is LossPath.CHUNKED:  # a sum: one "item", and a batch of no label token adds zero
        with loss_context(model):
            summed = chunked_causal_lm_loss(model, batch["input_ids"], inputs, batch["labels"], 1, plan)
        tokens = (batch["labels"][..., 1:] != IGNORE_INDEX).sum()
        return torch.tensor([float(summed), float(tokens)], dtype=torch.float64)
    logits = model(input_ids=batch["input_ids"], **inputs).logits
    return token_loss_totals(logits[..., :-1, :], batch["labels"][..., 1:])
