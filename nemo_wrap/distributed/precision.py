"""Precision: one vocabulary (``"fp32"``, ``"bf16"``, ``"bf16-mixed"``) for every strategy.

``"bf16-mixed"`` is the usual way to train in bf16: fp32 parameters (the master weights, so the
optimizer state is fp32 too), matmuls in bf16, gradients reduced in fp32. How the compute is cast
depends on who owns the parameters' working copy: FSDP2 all-gathers them anyway, so its
``MixedPrecisionPolicy`` gathers bf16 copies and reduce-scatters fp32 gradients; everywhere else
(one process, DDP, pure tensor parallel, Megatron-FSDP) the forward runs under ``torch.autocast``,
whose fp32 leaves receive fp32 gradients that DDP all-reduces as they are. ``"bf16"`` stores the
parameters themselves in bf16 — half the memory, but the optimizer then updates bf16 weights with
bf16 state, which the plan says in words.

The decision is :func:`precision_plan`, a pure function of the name and the layout, printed in the
load plan; :func:`apply_autocast` is its one action on a model. With neither ``precision`` nor
``dtype`` given, :func:`default_parameter_dtype` keeps the checkpoint's dtype unless the device
has no fast matmul in it (a CPU without bf16 instructions, :mod:`.hardware`): then the model trains
in fp32, and the plan says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from nemo_wrap.distributed.strategies import strategy_entry
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.vocabulary import Vocabulary


class Precision(Vocabulary):
    """``precision=``: what parameters are stored in and what the matmuls compute in."""

    FP32 = "fp32"
    BF16 = "bf16"
    BF16_MIXED = "bf16-mixed"


PRECISIONS: tuple[str, ...] = Precision.words()
PrecisionName = Literal["fp32", "bf16", "bf16-mixed"]  # the words, for type checkers (a test keeps them equal)

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass(frozen=True)
class PrecisionPlan:
    """The dtypes of parameters, compute and gradient reduction, and how the compute dtype is reached.

    ``cast_by``: ``"none"`` (compute in the parameters' dtype), ``"fully_shard"`` (FSDP2's
    ``MixedPrecisionPolicy``) or ``"autocast"``.
    """

    name: str
    parameter_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    cast_by: Literal["none", "fully_shard", "autocast"]

    @property
    def is_mixed(self) -> bool:
        return self.cast_by != "none"

    def __str__(self) -> str:
        parameters = _DTYPE_NAMES[self.parameter_dtype]
        if not self.is_mixed:
            optimizer = (
                "" if parameters == "fp32" else f"; the optimizer state is {parameters} (no fp32 master weights)"
            )
            return f"{self.name}: parameters, compute and gradients in {parameters}{optimizer}"
        how = "fully_shard's MixedPrecisionPolicy" if self.cast_by == "fully_shard" else "torch.autocast"
        return (
            f"{self.name}: {parameters} master weights and optimizer state, "
            f"{_DTYPE_NAMES[self.compute_dtype]} compute ({how}), "
            f"{_DTYPE_NAMES[self.reduce_dtype]} gradient reduction"
        )


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype parameters are built in, and why (printed in the plan)."""

    dtype: torch.dtype
    reason: str


def default_parameter_dtype(stored: torch.dtype, fast: frozenset[torch.dtype], device_type: str) -> DtypeChoice:
    """With neither ``precision`` nor ``dtype`` given: ``stored`` (the checkpoint's or config's
    dtype), unless it is a 16-bit dtype ``device_type`` does not multiply fast (not in ``fast``) —
    then fp32 compute and master weights, which train correctly and, there, far faster."""
    name = _DTYPE_NAMES[stored]
    if stored in (torch.bfloat16, torch.float16) and stored not in fast:
        return DtypeChoice(
            torch.float32,
            f"the weights are {name}, but this {device_type.upper()} has no fast {name} matmul, so fp32 "
            f"compute and master weights; pass precision= or dtype= to choose",
        )
    return DtypeChoice(stored, f"the weights' dtype, {name}")


def precision_plan(
    precision: Precision | PrecisionName | None,
    dtype: torch.dtype,
    strategy: str,
    dp_size: int,
    options: Any = None,
    dtype_reason: str = "the dtype",
) -> PrecisionPlan:
    """The precision of a model whose parameters are built in ``dtype``, under ``strategy`` (with
    its ``options``) on ``dp_size`` data-parallel ranks. Pure: strategy facts come from the registry.

    ``precision=None`` keeps ``dtype`` throughout (``dtype_reason`` says why it is that dtype),
    unless the strategy's own options cast (fsdp2's ``param_dtype`` / ``reduce_dtype``), which the
    plan then describes. A ``precision`` whose dtypes those options contradict raises
    :class:`InvalidSetupError` here, so ``plan()`` refuses it as the load would.
    """
    precision = _member(precision)
    with_precision = None if dp_size == 1 else strategy_entry(strategy).mixed_precision_options
    if precision is None:
        compute, reduce = getattr(options, "param_dtype", None), getattr(options, "reduce_dtype", None)
        if with_precision is not None and (compute or reduce):
            return PrecisionPlan("the strategy's own dtypes", dtype, compute or dtype, reduce or dtype, "fully_shard")
        name = f"{_DTYPE_NAMES[dtype]} (no precision given: {dtype_reason})"
        return PrecisionPlan(name, dtype, dtype, dtype, "none")
    if precision is Precision.BF16_MIXED:
        cast_by: Literal["none", "fully_shard", "autocast"] = "fully_shard" if with_precision else "autocast"
        plan = PrecisionPlan(precision.value, torch.float32, torch.bfloat16, torch.float32, cast_by)
    else:
        stored = torch.float32 if precision is Precision.FP32 else torch.bfloat16
        plan = PrecisionPlan(precision.value, stored, stored, stored, "none")
    if with_precision is not None and options is not None:  # the strategy's own dtypes must agree
        with_precision(options, plan.compute_dtype, plan.reduce_dtype)
    return plan


def parameter_dtype(precision: Precision | PrecisionName | None, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype parameters are built in: ``precision``'s, checked against an explicit ``dtype``
    (``None`` when neither decides, so the checkpoint's or config's dtype is used)."""
    precision = _member(precision)
    if precision is None:
        return dtype
    stored = torch.bfloat16 if precision is Precision.BF16 else torch.float32
    if dtype is not None and dtype != stored:
        raise InvalidSetupError(
            f"precision={precision.value!r} keeps parameters in {stored}, but dtype={dtype} was passed: "
            "drop one of them"
        )
    return stored


def _member(precision: Precision | PrecisionName | None) -> Precision | None:
    return None if precision is None else Precision.parse(precision, "precision")


def strategy_options(plan: PrecisionPlan, strategy: str, options: Any) -> Any:
    """The strategy's options with ``plan``'s mixed precision in them (unchanged unless FSDP2 casts).

    Raises :class:`InvalidSetupError` when the setup already sets its own conflicting dtypes.
    """
    if plan.cast_by != "fully_shard":
        return options
    with_precision: Callable[[Any, torch.dtype, torch.dtype], Any] | None
    with_precision = strategy_entry(strategy).mixed_precision_options
    assert with_precision is not None  # the plan casts by fully_shard only for such strategies
    return with_precision(options, plan.compute_dtype, plan.reduce_dtype)


def apply_autocast(model: nn.Module, plan: PrecisionPlan, device_type: str) -> None:
    """Run ``model``'s forward under ``torch.autocast`` when ``plan`` says so (a pre-hook enters it,
    a hook that runs even when the forward raises leaves it), so callers need no context of their own.

    Hooks rather than a ``forward`` override: transformers and its ``Trainer`` read ``forward``'s
    signature. Activation checkpointing recomputes under the autocast state it recorded.
    """
    if plan.cast_by != "autocast":
        return
    active: list[torch.autocast] = []

    def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
        context = torch.autocast(device_type, dtype=plan.compute_dtype)
        context.__enter__()
        active.append(context)

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if active:  # empty only if an earlier pre-hook raised before ``enter`` ran
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
