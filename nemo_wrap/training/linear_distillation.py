"""Distillation's cross-entropy and KL from the final hidden states, a chunk of tokens at a time.

The full path of :func:`~nemo_wrap.training.distillation.distillation_step` holds the student's
``[tokens, vocabulary]`` logits — with their fp32 upcast, two log-softmaxes and their gradient —
beside the teacher's. Here, as in :mod:`.linear_loss`, both heads' matmuls, the cross-entropy and
``T² · KL(softmax(teacher / T) ‖ softmax(student / T))`` run on ``chunk_tokens`` tokens at a time
(the student's loss plan's chunk), and each chunk's gradients of ``(1 − kd_ratio) · CE + kd_ratio
· KD`` are computed with its losses, its logits then freed: only ``[chunk_tokens, vocabulary]``
tensors are ever alive, and no matmul is recomputed in the backward.

The student's side runs in its own forward (transformers' ``loss_function`` slot, the head
projecting only the last position), so its head weight is what its strategy makes of it there:
FSDP2's gathered copy, whose gradient FSDP's hooks reduce-scatter as after any forward, or DDP's
replica.

The teacher's side cannot run inside the teacher's forward: every chunk needs the student's logits
at the same time, and a reference to FSDP2's gathered weight taken in a forward is freed when it
reshards. So the teacher's forward (``no_grad``, ``logits_to_keep=1``) gives only its final hidden
states, and its head weight is read whole once per step, outside any forward: a DTensor (a teacher
sharded by FSDP2 or HSDP) is gathered with ``full_tensor()``, an all-gather every rank makes at
the same point of the step. Reading a parameter's value outside FSDP's hooks is sound here only
because the teacher is frozen: no gradient is owed to the gathered copy, and the copy is ours.
FSDP2's root frees what it holds gathered at the end of a forward with gradients off (the
strategy's hook, ``ReshardAfterForward``), and is resharded before the read: the registered head
is then the shard (never FSDP's gathered copy), and the step holds one whole
``[vocabulary, hidden]`` head of the teacher, its own. An unsharded teacher's weight is used as it
is. A teacher whose loss plan keeps the full logits (``loss="full"``, a family whose head is not
verified) or that is tensor parallel gives its whole logits under ``no_grad`` instead and each
chunk is sliced from them: the student's are still never whole, so two vocabulary-sized logits are
never held at once.

Which students take this path is :func:`distillation_loss_plan`'s decision, stated as a
:class:`LossPlan`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.model_state import loss_plan_of, setup_of
from nemo_wrap.loading.plan import LossPath, LossPlan
from nemo_wrap.models.head import HeadTransform
from nemo_wrap.training.linear_loss import (
    chunked_unless_built_whole,
    output_with_loss,
    saved_gradients_scaled,
    shifted_labels,
)
from nemo_wrap.training.step import forward_inputs, labels_of
from nemo_wrap.training.token_loss import IGNORE_INDEX


def distillation_loss_plan(student: nn.Module) -> LossPlan:
    """How :func:`~nemo_wrap.training.distillation.distillation_step` computes ``student``'s losses:
    chunked where its own loss plan is, except where distillation is not built chunked — a student
    that adds a load-balancing loss (it is assembled beside the whole logits, as ``train_step``
    does) and a tensor-parallel one (its chunks' logits are vocabulary shards, whose KL with the
    teacher's is not built): those compute their whole logits, and the plan says why."""
    return chunked_unless_built_whole(student, "the KL of vocabulary-sharded chunks is not built")


def check_same_vocabulary(teacher_entries: int, student_entries: int) -> None:
    """Refuse logits over different vocabularies: the KL compares distributions over one."""
    if teacher_entries != student_entries:
        raise InvalidSetupError(
            f"distillation_step: the teacher's logits have {teacher_entries} vocabulary entries, "
            f"the student's {student_entries}; the models must share one vocabulary"
        )


@dataclass(frozen=True)
class _Mix:
    """What every chunk computes besides its tensors: the losses' mix and the student's head."""

    kd_ratio: float
    temperature: float
    chunk_tokens: int
    transform: HeadTransform


@dataclass(frozen=True)
class _TeacherChunks:
    """The teacher's fp32 logits of any chunk of a micro-batch's flattened tokens: its final hidden
    states (``source``) through its whole head ``weight`` and ``transform``, or, without a weight,
    rows sliced from its whole logits (``source``)."""

    source: torch.Tensor
    weight: torch.Tensor | None = None
    transform: HeadTransform = field(default_factory=HeadTransform)

    @property
    def vocabulary(self) -> int:
        return self.source.shape[-1] if self.weight is None else self.weight.shape[0]

    def __call__(self, rows: slice) -> torch.Tensor:
        if self.weight is None:
            return self.source[rows].float()
        return self.transform(F.linear(self.source[rows], self.weight).float())


class ChunkedDistillation:
    """One step's chunked distillation: built once per step (reading the teacher's head whole, a
    collective where it is sharded), then :meth:`losses` for each micro-batch."""

    def __init__(self, student: nn.Module, teacher: nn.Module, kd_ratio: float, temperature: float) -> None:
        plan = loss_plan_of(student)
        self._student, self._teacher = student, teacher
        self._mix = _Mix(kd_ratio, temperature, plan.chunk_tokens, plan.transform or HeadTransform())
        self._teacher_head = _whole_teacher_head(teacher)

    def losses(
        self, batch: Mapping[str, torch.Tensor], label_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, CE, KD) of one micro-batch, each over the step's global ``label_tokens``; the loss
        carries the gradients (the CE and KD are values)."""
        teacher = self._teacher_chunks(batch)
        student_head = self._student.get_output_embeddings().weight  # type: ignore[operator]
        check_same_vocabulary(teacher.vocabulary, student_head.shape[0])
        parts: dict[str, torch.Tensor] = {}

        def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            flat_hidden = hidden.reshape(-1, hidden.shape[-1])
            summed = _ChunkedMixedLoss.apply(flat_hidden, weight, labels.reshape(-1), teacher, self._mix)
            mixed, parts["ce"], parts["kd"] = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], summed)
            return mixed

        inputs = {"input_ids": batch["input_ids"], **forward_inputs(batch)}
        total = output_with_loss(self._student, inputs, shifted_labels(labels_of(batch)), label_tokens, loss).loss
        return total, parts["ce"] / label_tokens, parts["kd"] / label_tokens

    def _teacher_chunks(self, batch: Mapping[str, torch.Tensor]) -> _TeacherChunks:
        with torch.no_grad():
            if self._teacher_head is None:
                logits = self._teacher(input_ids=batch["input_ids"], **forward_inputs(batch)).logits
            else:
                hidden = _final_hidden_states(self._teacher, batch)
        if self._teacher_head is None:
            return _TeacherChunks(logits.reshape(-1, logits.shape[-1]))
        weight, transform = self._teacher_head
        flat = hidden.reshape(-1, hidden.shape[-1])
        return _TeacherChunks(flat, weight.to(flat.dtype), transform)  # FSDP2's param_dtype: the forward's


def _whole_teacher_head(teacher: nn.Module) -> tuple[torch.Tensor, HeadTransform] | None:
    """The teacher's head weight, whole on this rank, and its transform; ``None`` where the teacher
    gives its whole logits (its loss plan keeps them, or it is tensor parallel)."""
    plan = loss_plan_of(teacher)
    if plan.path is LossPath.FULL or setup_of(teacher).uses_tensor_parallel:
        return None
    _drop_gathered_root(teacher)  # its registered head is then the shard: no copy of FSDP's is referenced
    weight = teacher.get_output_embeddings().weight.detach()  # type: ignore[operator]
    whole = weight.full_tensor() if isinstance(weight, DTensor) else weight  # frozen: a read of its value
    return whole, plan.transform or HeadTransform()


def _drop_gathered_root(teacher: nn.Module) -> None:
    """Free what FSDP2 holds gathered in a teacher's root: a forward with gradients on, that no
    backward followed, leaves it registered, and a reference to it would be freed under us at the
    next reshard. ``reshard`` is FSDP2's own call for this (a no-op where nothing is gathered)."""
    if isinstance(teacher, FSDPModule):
        teacher.reshard()


def _final_hidden_states(model: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The decoder's output on ``batch``, from a forward whose head projects the last position only."""
    captured: dict[str, torch.Tensor] = {}
    handle = model.get_decoder().register_forward_hook(_keeper(captured))
    try:
        model(input_ids=batch["input_ids"], **forward_inputs(batch), logits_to_keep=1)
    finally:
        handle.remove()
    return captured["hidden"]


def _keeper(captured: dict[str, torch.Tensor]) -> Callable[[nn.Module, Any, Any], None]:
    """A forward hook for the decoder that keeps its final hidden states in ``captured``."""

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    return keep


class _ChunkedMixedLoss(torch.autograd.Function):
    """``(1 − kd_ratio) · CE + kd_ratio · KD`` summed over the label tokens, with the CE and KD sums
    beside it (values, not differentiated). The mix's gradients are computed in the forward, chunk
    by chunk, and kept until the backward — ``[tokens, hidden]`` and ``[vocabulary, hidden]``."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        teacher: _TeacherChunks,
        mix: _Mix,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wanted = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        sums, grad_hidden, grad_weight = _chunked_sums(hidden, weight, labels, teacher, mix, wanted)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        mixed, ce, kd = (value.clone() for value in sums)
        ctx.mark_non_differentiable(ce, kd)
        return mixed, ce, kd

    @staticmethod
    def backward(ctx: Any, grad_mixed: torch.Tensor, *ignored: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return *saved_gradients_scaled(ctx, grad_mixed), None, None, None


def _chunked_sums(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    teacher: _TeacherChunks,
    mix: _Mix,
    wanted: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The (mix, CE, KD) sums and, for the inputs ``wanted`` (hidden states, weight), the mix's
    gradients (the weight's summed over the chunks in fp32, whatever the weight's dtype)."""
    sums = torch.zeros(3, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros_like(hidden) if wanted[0] else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None
    for start in range(0, labels.numel(), mix.chunk_tokens):
        rows = slice(start, start + mix.chunk_tokens)
        if not bool((labels[rows] != IGNORE_INDEX).any()):  # a chunk of prompt or padding adds nothing
            continue
        with torch.enable_grad():
            chunk_hidden = hidden[rows].detach().requires_grad_(wanted[0])
            chunk_weight = weight.detach().requires_grad_(wanted[1])
            ce, kd = _chunk_losses(chunk_hidden, chunk_weight, labels[rows], teacher(rows), mix)
            mixed = (1.0 - mix.kd_ratio) * ce + mix.kd_ratio * kd
            inputs = [t for t, want in zip((chunk_hidden, chunk_weight), wanted, strict=True) if want]
            grads = iter(torch.autograd.grad(mixed, inputs) if inputs else ())
            if grad_hidden is not None:
                grad_hidden[rows] = next(grads)
            if grad_weight is not None:
                grad_weight += next(grads)
        sums += torch.stack([mixed, ce, kd]).detach()
    return sums, grad_hidden, grad_weight


def _chunk_losses(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor, mix: _Mix
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's CE and ``T² ·`` KL sums over its label tokens, in fp32, as the full path's."""
    logits = mix.transform(F.linear(hidden, weight).float())
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    keep = labels != IGNORE_INDEX
    student = torch.log_softmax(logits[keep] / mix.temperature, dim=-1)
    teacher = torch.log_softmax(teacher_logits[keep] / mix.temperature, dim=-1)
    kd = mix.temperature**2 * F.kl_div(student, teacher, reduction="sum", log_target=True)
    return ce, kd
