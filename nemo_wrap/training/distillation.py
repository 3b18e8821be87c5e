"""Knowledge distillation: one optimizer step that pulls a student toward a frozen teacher.

The standard formulation (Hinton, Vinyals & Dean, "Distilling the Knowledge in a Neural Network",
2015): soften both models' logits with a temperature ``T``, take the KL divergence from the
teacher's distribution to the student's, scale it by ``T²`` (so its gradients keep their size as
``T`` changes) and mix it with the usual cross-entropy on the labels::

    loss = (1 − kd_ratio) · CE + kd_ratio · T² · KL(softmax(teacher / T) ‖ softmax(student / T))

Why a step of its own and not a loss handed to ``train_step``: both terms must mean what they mean
in one process. As in :func:`~nemo_wrap.training.step.train_step`, each is summed over the label
tokens (positions whose shifted label is not -100), divided by the step's label count over every
micro-batch of every data-parallel rank, and back-propagated scaled by the dp degree to undo the
managers' gradient averaging; so under DDP or FSDP2 the loss and the gradients are one process's
on the whole batch. The teacher runs in eval mode under ``no_grad``, one micro-batch at a time (its
logits are dropped after each), and the KL is computed in float32.

Where the student's loss plan is chunked (:func:`.linear_distillation.distillation_loss_plan`),
neither model's ``[tokens, vocabulary]`` logits are formed: both losses are computed from the
final hidden states a chunk of tokens at a time, in the student's forward
(:mod:`.linear_distillation`, which also says how a sharded teacher's head is read). A student
keeps the whole logits under tensor parallel, with a load-balancing loss, or with
``loss="full"``; under tensor parallel the lm_head then gathers them over the vocabulary (a
``Replicate`` output, see :mod:`nemo_wrap.distributed.tensor_parallel`), so every tp rank computes
the same whole loss, as transformers' cross-entropy does there. A pipeline stage or a
context-parallel part holds no whole logits of its rows: pp and cp are refused before any
collective. Under plain DDP the teacher is loaded without a setup (every rank holds the whole
model either way; DDP's ``replicate`` refuses a model that takes no gradient); under FSDP2 (and
DDP × TP) it is sharded like the student.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nemo_wrap.distributed.combinations import Feature, refuse_unsupported, setup_arguments
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.model_state import setup_of
from nemo_wrap.loading.plan import LossPath
from nemo_wrap.training.accumulation import no_gradient_sync
from nemo_wrap.training.linear_distillation import ChunkedDistillation, check_same_vocabulary, distillation_loss_plan
from nemo_wrap.training.step import (
    StepResult,
    forward_inputs,
    global_label_tokens,
    labels_of,
    logits_and_router_loss,
    optimizer_update,
)
from nemo_wrap.training.token_loss import IGNORE_INDEX, causal_lm_loss


@dataclass(frozen=True)
class DistillationSettings:
    """What a distillation run adds to a training job: the teacher (a path or hub id) and the mix."""

    teacher: str
    kd_ratio: float = 0.5
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.teacher:
            raise InvalidSetupError("teacher='': name the teacher checkpoint (a directory or a hub id)")
        check_kd_arguments(self.kd_ratio, self.temperature)


@dataclass(frozen=True)
class DistillationResult(StepResult):
    """A step's result with the two parts of its loss, each a global mean over the label tokens:
    ``loss = (1 − kd_ratio) · ce_loss + kd_ratio · kd_loss`` (plus an MoE student's load-balancing loss)."""

    ce_loss: float
    kd_loss: float


def check_kd_arguments(kd_ratio: float, temperature: float) -> None:
    """Refuse a ``kd_ratio`` outside [0, 1] or a ``temperature`` that is not a finite positive number."""
    if not 0.0 <= kd_ratio <= 1.0:  # NaN fails here too
        raise InvalidSetupError(f"kd_ratio={kd_ratio!r}: must lie in [0, 1] (the KD loss's share of the loss)")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise InvalidSetupError(f"temperature={temperature!r}: must be a finite number > 0")


def freeze_teacher(model: nn.Module) -> nn.Module:
    """``model`` with no parameter requiring a gradient, in eval mode (dropout off); returned for chaining."""
    model.requires_grad_(False)
    return model.eval()


def kd_loss_sum(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``T² ·`` the sum over label tokens of ``KL(softmax(teacher / T) ‖ softmax(student / T))``, in float32.

    ``labels`` are unshifted, as transformers takes them: the logits at position ``i`` are compared
    where label ``i + 1`` is not -100.
    """
    keep = (labels[..., 1:] != IGNORE_INDEX).to(student_logits.device)
    student = torch.log_softmax(student_logits[..., :-1, :][keep].float() / temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits[..., :-1, :][keep].float() / temperature, dim=-1)
    return temperature**2 * F.kl_div(student, teacher, reduction="sum", log_target=True)


def distillation_step(
    student: nn.Module,
    teacher: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    kd_ratio: float,
    temperature: float,
    max_grad_norm: float | None = None,
) -> DistillationResult:
    """One step of ``student`` on ``(1 − kd_ratio) · CE + kd_ratio · KD`` against ``teacher``.

    The batches are ``train_step``'s (``input_ids``, optional ``labels``, ``attention_mask``,
    ``position_ids``); every rank of the job calls it with its own. ``teacher`` is put in eval mode
    and never receives a gradient (:func:`freeze_teacher` also stops it from asking for one); it may
    be sharded by the student's FSDP2 or DDP × TP setup (under plain DDP it is loaded without one).
    The result's losses are global means, the same on every rank.
    """
    check_kd_arguments(kd_ratio, temperature)
    _check_supported(student, teacher)
    setup = setup_of(student)
    group = setup.dp_group()  # the label tokens are counted over dp
    dp_size = 1 if group is None else dist.get_world_size(group)
    label_tokens = global_label_tokens(micro_batches, group, "distillation_step")
    teacher.eval()
    chunked = None
    if distillation_loss_plan(student).path is LossPath.CHUNKED:  # reads the teacher's head: a collective
        chunked = ChunkedDistillation(student, teacher, kd_ratio, temperature)
    sums = torch.zeros(3)  # loss, CE, KD: float32 like train_step's loss sum
    for index, batch in enumerate(micro_batches):
        with nullcontext() if index == len(micro_batches) - 1 else no_gradient_sync(student):
            if chunked is not None:
                losses = chunked.losses(batch, label_tokens)
            else:
                losses = _micro_batch_losses(student, teacher, batch, label_tokens, (kd_ratio, temperature), group)
            (losses[0] * dp_size).backward()  # the managers average over dp: scaled back to the sum
        sums += torch.stack([loss.detach().float().cpu() for loss in losses])
    grad_norm = optimizer_update(student, optimizer, max_grad_norm)
    if group is not None:
        dist.all_reduce(sums, group=group)
    loss, ce_loss, kd_loss = (float(value) for value in sums)
    return DistillationResult(loss, grad_norm, label_tokens, ce_loss=ce_loss, kd_loss=kd_loss)


def _micro_batch_losses(
    student: nn.Module,
    teacher: nn.Module,
    batch: Mapping[str, torch.Tensor],
    label_tokens: int,
    mix: tuple[float, float],
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, CE, KD) of one micro-batch from both models' whole logits, each over the step's global
    label count; ``mix`` is ``(kd_ratio, temperature)``."""
    kd_ratio, temperature = mix
    logits, router_loss = logits_and_router_loss(student, batch, group)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=batch["input_ids"], **forward_inputs(batch)).logits
    check_same_vocabulary(teacher_logits.shape[-1], logits.shape[-1])
    labels = labels_of(batch)
    ce = causal_lm_loss(student, logits, label_tokens, labels=labels)
    kd = kd_loss_sum(logits, teacher_logits, labels, temperature) / label_tokens
    return (1.0 - kd_ratio) * ce + kd_ratio * kd + router_loss, ce, kd


def _check_supported(student: nn.Module, teacher: nn.Module) -> None:
    """Refuse, before any collective, what the combination table refuses of either model's layout
    (a teacher adds :attr:`Feature.FROZEN_MODEL`), and a vocabulary mismatch."""
    refuse_unsupported("distillation_step", setup_arguments(setup_of(student)) | {Feature.DISTILLATION: "the student"})
    teacher_roles = dict.fromkeys((Feature.DISTILLATION, Feature.FROZEN_MODEL), "the teacher")
    refuse_unsupported("distillation_step", setup_arguments(setup_of(teacher)) | teacher_roles)
    student_vocab, teacher_vocab = student.config.vocab_size, teacher.config.vocab_size  # type: ignore[union-attr]
    if student_vocab != teacher_vocab:
        raise InvalidSetupError(
            f"distillation_step: teacher vocab_size={teacher_vocab} but student vocab_size={student_vocab}; "
            "the KL compares distributions over one vocabulary, so the models must share their tokenizer"
        )
