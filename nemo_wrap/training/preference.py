"""Preference tuning: one optimizer step of DPO or SimPO on a batch of (chosen, rejected) pairs.

The objectives are :mod:`.preference_loss`'s; this module runs them as ``train_step`` runs the
cross-entropy, so that every layout trains as one process does: the step's loss is the mean over
every real pair of every micro-batch of every data-parallel rank (each micro-batch's pair-loss
sum over that global count, back-propagated scaled by the dp degree to undo the managers'
gradient averaging), and its metrics — TRL's ``rewards/chosen``, ``rewards/rejected``,
``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected`` — are means over
the same pairs. Under tensor parallel every tp rank holds the same pairs and computes the same
loss. Pipeline and context parallel hold no sequence's whole log-probability on one rank: refused
before any collective (the combination table's :attr:`Feature.PREFERENCE` rows).

Where the log-probabilities come from is :func:`preference_loss_plan`'s decision: a chunk of pairs
at a time where the model's loss plan is chunked (:mod:`.sequence_scores`), else the whole
logits — under tensor parallel (a vocabulary-sharded chunk's log-softmax is not built here) and
for an MoE model that adds a load-balancing loss (assembled beside the logits, as ``train_step``
does).

The reference a DPO step compares with is :class:`Reference`, made by :func:`reference_for`:
where the model's trainable weights are LoRA adapters alone, the same model with its adapters
switched off (one set of weights, as TRL does with PEFT); otherwise — full fine-tuning, or LoRA
that also trains whole modules (``modules_to_save``) — a frozen copy the caller loads through the
same audited pipeline and setup, as a distillation teacher is. SimPO needs none.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from peft import LoraConfig
from torch import nn

from nemo_wrap.distributed.combinations import Feature, refuse_unsupported, setup_arguments
from nemo_wrap.errors import InvalidSetupError, TrainingDataError
from nemo_wrap.loading.model_state import HasModelState, loss_plan_of, setup_of
from nemo_wrap.loading.plan import LossPath, LossPlan
from nemo_wrap.models.lora import adapters_disabled
from nemo_wrap.training.accumulation import no_gradient_sync
from nemo_wrap.training.linear_loss import chunked_unless_built_whole, output_with_loss, shifted_labels
from nemo_wrap.training.preference_loss import (
    PairTerms,
    PreferenceSettings,
    SequenceScores,
    objective_scores,
    pair_terms,
    real_pairs,
)
from nemo_wrap.training.sequence_scores import PairLosses, chunked_scores_loss, scores_from_logits
from nemo_wrap.training.step import (
    StepResult,
    forward_inputs,
    global_label_tokens,
    logits_and_router_loss,
    optimizer_update,
)
from nemo_wrap.training.token_loss import IGNORE_INDEX

Batch = Mapping[str, torch.Tensor]
METRICS = ("chosen_rewards", "rejected_rewards", "margins", "accuracy", "chosen_log_probs", "rejected_log_probs")


class ReferenceSource(enum.Enum):
    """Where a DPO step's reference log-probabilities come from (:func:`reference_source`)."""

    NONE = "none: the objective is reference-free"
    ADAPTERS_OFF = "the model itself with its LoRA adapters switched off (one set of weights)"
    FROZEN_COPY = "a frozen copy of the starting checkpoint, loaded and sharded like the model"


def reference_source(settings: PreferenceSettings, lora_config: LoraConfig | None) -> ReferenceSource:
    """The reference a preference run needs: none for a reference-free objective; the base model
    (adapters off) when only adapters train; else a frozen copy (a ``modules_to_save`` module
    trains in place, so switching the adapters off would not give the starting model back)."""
    if not settings.objective.needs_reference:
        return ReferenceSource.NONE
    if lora_config is not None and not lora_config.modules_to_save:
        return ReferenceSource.ADAPTERS_OFF
    return ReferenceSource.FROZEN_COPY


@dataclass(frozen=True)
class Reference:
    """The reference of a preference step: ``model`` (a frozen copy, or the policy itself whose
    adapters are switched off while it scores), or none."""

    source: ReferenceSource
    model: nn.Module | None = None

    def log_probs(self, batch: Batch) -> torch.Tensor | None:
        """Each sequence's completion log-probability under the reference, without gradients and
        in eval mode (no dropout: the policy switched to its base is put back as it was)."""
        if self.model is None:
            return None
        switch: AbstractContextManager[None] = (
            adapters_disabled(self.model) if self.source is ReferenceSource.ADAPTERS_OFF else nullcontext()
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with switch, torch.no_grad():
                return _scores(self.model, batch, None, 1)[1].log_probs
        finally:
            self.model.train(was_training)


def reference_for(model: nn.Module, settings: PreferenceSettings, frozen_copy: nn.Module | None = None) -> Reference:
    """The :class:`Reference` of :func:`reference_source` for ``model``; ``frozen_copy`` (frozen,
    eval mode: :func:`~nemo_wrap.training.distillation.freeze_teacher`) must be given exactly where
    that source is a frozen copy."""
    lora_config = model.nemo_state.lora_config if isinstance(model, HasModelState) else None
    source = reference_source(settings, lora_config)
    if (source is ReferenceSource.FROZEN_COPY) != (frozen_copy is not None):
        needed = "needs a frozen copy of the starting checkpoint" if frozen_copy is None else "takes no frozen copy"
        raise InvalidSetupError(f"{settings.objective.value} on this model {needed}: its reference is {source.value}")
    held = {ReferenceSource.NONE: None, ReferenceSource.ADAPTERS_OFF: model, ReferenceSource.FROZEN_COPY: frozen_copy}
    return Reference(source, held[source])


@dataclass(frozen=True)
class PreferenceResult(StepResult):
    """A step's result with TRL's preference metrics, each a mean over the step's real pairs:
    the completions' rewards, their margin, the fraction of pairs whose chosen reward is higher,
    and the completions' log-probabilities under the policy as the objective reads them (summed
    for dpo, per-token means for simpo)."""

    pairs: int
    chosen_rewards: float
    rejected_rewards: float
    margins: float
    accuracy: float
    chosen_log_probs: float
    rejected_log_probs: float

    def metrics(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in METRICS}


def preference_loss_plan(model: nn.Module) -> LossPlan:
    """How a preference step computes ``model``'s log-probabilities (module docstring)."""
    return chunked_unless_built_whole(model, "the log-softmax of vocabulary-sharded chunks is not built")


def preference_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    settings: PreferenceSettings,
    reference: Reference,
    max_grad_norm: float | None = None,
) -> PreferenceResult:
    """One step of ``settings.objective`` on micro-batches of pairs (rows of
    :func:`~nemo_wrap.data.preferences.pair_rows`: chosen and rejected sequences alternating).

    Every rank of the job calls it with its own micro-batches; the result is the same on every
    rank. ``reference``: :func:`reference_for`'s.
    """
    _check_supported(model, settings, reference)
    group, multiple = setup_of(model).dp_group(), _sequence_multiple(model)  # pairs and tokens: counted over dp
    dp_size = 1 if group is None else dist.get_world_size(group)
    label_tokens = global_label_tokens(micro_batches, group, "preference_step")
    pairs = global_pairs(micro_batches, group)
    sums = torch.zeros(1 + len(METRICS), dtype=torch.float64)  # loss, then METRICS
    for index, batch in enumerate(without_trailing_padding(b, multiple) for b in micro_batches):
        reference_log_probs = reference.log_probs(batch)
        with nullcontext() if index == len(micro_batches) - 1 else no_gradient_sync(model):
            loss, terms, scores = _micro_batch(model, batch, settings, reference_log_probs, (pairs, group))
            (loss * dp_size).backward()  # the managers average over dp: scaled back to the sum
        sums += torch.cat([loss.detach().double().cpu().reshape(1), _metric_sums(settings, terms, scores)])
    grad_norm = optimizer_update(model, optimizer, max_grad_norm)
    if group is not None:
        dist.all_reduce(sums, group=group)
    loss_value, *means = (float(value) for value in sums[:1].tolist() + (sums[1:] / pairs).tolist())
    return PreferenceResult(loss_value, grad_norm, label_tokens, pairs, *means)


def global_pairs(micro_batches: Sequence[Batch], group: dist.ProcessGroup | None) -> int:
    """The step's real pairs over every micro-batch of every rank of ``group``; none is an error."""
    local = sum(int(real_pairs(_label_counts(batch)).sum()) for batch in micro_batches)
    count = torch.tensor([local], dtype=torch.int64)
    if group is not None:
        dist.all_reduce(count, group=group)
    if int(count) == 0:
        raise TrainingDataError("preference_step: the micro-batches hold no pair with completion tokens on any rank")
    return int(count)


def without_trailing_padding(batch: Batch, multiple: int = 1) -> Batch:
    """``batch`` cut after the last position any of its sequences learns (rounded up to a
    ``multiple``: sequence parallel splits the positions over the tp ranks): pairs are padded to
    ``max_length``, and in a causal model the positions after the last label change nothing
    before them, so the cut is exact and saves their whole forward and backward."""
    learned = (batch["labels"] != IGNORE_INDEX).any(dim=0).nonzero()
    length = int(learned.max()) + 1 if len(learned) else 1
    length = min(-(-length // multiple) * multiple, batch["labels"].shape[1])
    return {key: value[:, :length] if value.dim() == 2 else value for key, value in batch.items()}


def _label_counts(batch: Batch) -> torch.Tensor:
    """Each sequence's completion tokens (labels not -100 after the one-position shift)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1)


def _micro_batch(
    model: nn.Module,
    batch: Batch,
    settings: PreferenceSettings,
    reference: torch.Tensor | None,
    count: tuple[int, dist.ProcessGroup | None],
) -> tuple[torch.Tensor, PairTerms, SequenceScores]:
    """One micro-batch's loss (its pair-loss sum over the step's global pair count, plus an MoE
    model's load-balancing share), its pair terms and the policy's scores."""
    pairs, group = count

    def losses(scores: SequenceScores, first: int) -> torch.Tensor:
        run = None if reference is None else reference[first : first + len(scores.log_probs)]
        return pair_terms(settings, scores, run).losses

    loss, scores = _scores(model, batch, losses, pairs, group)
    return loss, pair_terms(settings, scores, reference), scores


def _scores(
    model: nn.Module, batch: Batch, losses: PairLosses | None, pairs: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, SequenceScores]:
    """``model``'s loss (``losses`` summed over its pairs, over ``pairs``; zero without ``losses``)
    and every sequence's scores, by :func:`preference_loss_plan`'s path."""
    inputs = {"input_ids": batch["input_ids"], **forward_inputs(batch)}
    if preference_loss_plan(model).path is LossPath.CHUNKED:
        into: dict[str, SequenceScores] = {}
        in_forward = chunked_scores_loss(loss_plan_of(model), losses, into)
        output = output_with_loss(model, inputs, shifted_labels(batch["labels"]), pairs, in_forward)
        return output.loss, into["scores"]
    logits, router_loss = logits_and_router_loss(model, batch, group)
    scores = scores_from_logits(logits, batch["labels"])
    loss = losses(scores, 0).sum() / pairs + router_loss if losses is not None else router_loss
    return loss, scores if losses is not None else SequenceScores(scores.log_probs.detach(), scores.tokens)


def _metric_sums(settings: PreferenceSettings, terms: PairTerms, scores: SequenceScores) -> torch.Tensor:
    """The sums of :data:`METRICS` over a micro-batch's real pairs (padding pairs add zero)."""
    real = real_pairs(scores.tokens).double()
    chosen, rejected = terms.chosen_rewards.detach().double(), terms.rejected_rewards.detach().double()
    log_probs = objective_scores(settings, scores).detach().double()
    sums = [chosen, rejected, chosen - rejected, (chosen > rejected).double() * real]
    sums += [log_probs[0::2] * real, log_probs[1::2] * real]
    return torch.stack([values.sum() for values in sums]).cpu()


def _check_supported(model: nn.Module, settings: PreferenceSettings, reference: Reference) -> None:
    """Refuse, before any collective (of a step or an evaluation), a layout the combination table
    refuses for preference tuning, and a missing reference."""
    objective = settings.objective.value
    refuse_unsupported("preference_step", setup_arguments(setup_of(model)) | {Feature.PREFERENCE: objective})
    if settings.objective.needs_reference and reference.model is None:
        raise InvalidSetupError(f"preference_step: {objective} needs a reference (reference_for makes it)")


def evaluate_preferences(
    model: nn.Module, micro_batches: Sequence[Batch], settings: PreferenceSettings, reference: Reference
) -> dict[str, float]:
    """Held-out means over every real pair of every rank: the loss, TRL's reward accuracy and
    margin, and ``prefers_chosen`` — the fraction of pairs whose chosen completion the model
    itself finds more likely per token (its mean token log-probability is higher), which unlike
    the reward accuracy (0 before training: every reward is 0) says where the model starts.

    Every rank of the job calls it with the same number of micro-batches."""
    _check_supported(model, settings, reference)
    was_training = model.training
    model.eval()
    sums = torch.zeros(5, dtype=torch.float64)  # loss, accuracy, margin, prefers chosen, pairs
    multiple = _sequence_multiple(model)
    try:
        with torch.no_grad():
            for batch in micro_batches:
                sums += _evaluation_sums(model, without_trailing_padding(batch, multiple), settings, reference)
    finally:
        model.train(was_training)
    group = setup_of(model).dp_group()
    if group is not None:
        dist.all_reduce(sums, group=group)
    *totals, pairs = sums.tolist()
    if pairs == 0:
        raise TrainingDataError("evaluate_preferences: the held-out micro-batches hold no pair with completion tokens")
    names = ("eval_loss", "eval_rewards_accuracy", "eval_rewards_margin", "eval_prefers_chosen")
    return {name: total / pairs for name, total in zip(names, totals, strict=True)}


def _evaluation_sums(
    model: nn.Module, batch: Batch, settings: PreferenceSettings, reference: Reference
) -> torch.Tensor:
    """One held-out micro-batch's sums: pair losses, correct rewards, margins, pairs whose chosen
    answer has the higher mean token log-probability, real pairs."""
    reference_log_probs = reference.log_probs(batch)
    _, scores = _scores(model, batch, None, 1)
    terms = pair_terms(settings, scores, reference_log_probs)
    metrics = _metric_sums(settings, terms, scores)
    means, real = scores.mean_log_probs(), real_pairs(scores.tokens)
    prefers = ((means[0::2] > means[1::2]) & real).sum()
    return torch.stack([terms.losses.sum().double(), metrics[3], metrics[2], prefers.double(), real.sum().double()])


def _sequence_multiple(model: nn.Module) -> int:
    """What a batch's length must divide by: the tp degree under sequence parallel, else 1."""
    setup = setup_of(model)
    return setup.degrees.tp if setup.sequence_parallel else 1
