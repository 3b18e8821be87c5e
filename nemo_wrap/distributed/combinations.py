"""What combines with what: one table, read by every check that refuses a combination.

A job is a set of :class:`Feature` values — the parallel degrees above 1, the traits of its strategy,
and what the caller adds (4-bit layers, compiled layers, a load-balancing loss, a distillation
teacher…) — each named by the argument that turned it on. :data:`REFUSALS` lists the pairs that do
not compose, why, and the way out. The load resolver, ``train_step`` and ``distillation_step``
call :func:`refuse_unsupported` with the features they know (``evaluate`` adds none a load has not
already checked), so a refusal is written once and reads the same wherever it is met. Which degrees each strategy takes
is the strategy registry's data (``StrategyEntry.degrees``);
:func:`nemo_wrap.distributed.support.support_matrix` prints both, and the README shows its output
(a test keeps them equal).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nemo_wrap.errors import (
    InvalidSetupError,
    NeMoWrapError,
    UnsupportedModelError,
    UnsupportedQuantizationError,
    UnsupportedSetupError,
)

if TYPE_CHECKING:
    from nemo_wrap.distributed.setup import DistributedSetup


class Feature(enum.Enum):
    """One thing a job can use; the value is its name in the support matrix."""

    TENSOR = "tensor parallel"
    SEQUENCE = "sequence parallel (of tensor parallel)"
    PIPELINE = "pipeline parallel"
    CONTEXT = "context parallel"
    EXPERT = "expert parallel"
    REPLICATED = "a strategy that replicates the model (DDP)"
    FLAT_BUFFERS = "a strategy of flat parameter buffers (Megatron-FSDP)"
    FOUR_BIT = "4-bit layers (QLoRA)"
    FROM_CONFIG = "from_config (no checkpoint)"
    BF16_MIXED = "bf16-mixed precision"
    COMPILE = "compiled layers"
    ROUTER_LOSS = "a load-balancing loss (MoE)"
    DISTILLATION = "distillation (student or teacher)"
    FROZEN_MODEL = "a frozen model (distillation teacher, DPO reference)"
    PREFERENCE = "preference tuning (dpo, simpo)"


@dataclass(frozen=True)
class Refusal:
    """Two features that do not compose (unless the job also has one of ``unless``), the error a
    caller gets, why, and what to change instead."""

    first: Feature
    second: Feature
    error: type[NeMoWrapError]
    reason: str
    way_out: str
    unless: frozenset[Feature] = frozenset()

    def applies(self, features: Iterable[Feature]) -> bool:
        present = set(features)
        return {self.first, self.second} <= present and not self.unless & present

    def describe(self, arguments: Mapping[Feature, str]) -> str:
        return f"{arguments[self.first]} does not compose with {arguments[self.second]} ({self.reason}): {self.way_out}"


def _four_bit(second: Feature, reason: str, way_out: str) -> Refusal:
    return Refusal(Feature.FOUR_BIT, second, UnsupportedQuantizationError, reason, way_out)


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        Feature.EXPERT,
        Feature.CONTEXT,
        UnsupportedSetupError,
        "expert parallel is not built beside context parallel yet",
        "use cp_size=1 or ep_size=1",
    ),
    Refusal(
        Feature.SEQUENCE,
        Feature.PIPELINE,
        UnsupportedSetupError,
        "pipeline stages hand each other whole hidden states, not sequence-cut DTensors",
        "use sequence_parallel=False or pp_size=1",
    ),
    Refusal(
        Feature.CONTEXT,
        Feature.PIPELINE,
        UnsupportedModelError,
        "context-parallel attention is not built inside pipeline stages",
        "choose one of them",
    ),
    Refusal(
        Feature.COMPILE,
        Feature.TENSOR,
        InvalidSetupError,
        "on this torch a compiled layer of DTensors hands plain-tensor gradients to DTensor's backward",
        "use compile=False or tp_size=1",
    ),
    _four_bit(
        Feature.FROM_CONFIG, "4-bit layers are quantized from a checkpoint while it is read", "use from_pretrained"
    ),
    _four_bit(
        Feature.FLAT_BUFFERS,
        "Megatron-FSDP's flat buffers do not hold bitsandbytes' layers",
        "use strategy fsdp2 or ddp",
    ),
    _four_bit(
        Feature.TENSOR,
        "4-bit layers are sharded by whole rows only; a row-wise layer would split them by columns",
        "use tp_size=1",
    ),
    _four_bit(Feature.PIPELINE, "pipeline stages of 4-bit layers are not built", "use pp_size=1"),
    _four_bit(Feature.CONTEXT, "context parallel with 4-bit layers is not built", "use cp_size=1"),
    _four_bit(Feature.EXPERT, "MoE experts are 3-D tensors, which bitsandbytes' layers do not hold", "use ep_size=1"),
    _four_bit(
        Feature.BF16_MIXED,
        "4-bit layers compute in their own dtype",
        "set bnb_4bit_compute_dtype=torch.bfloat16 instead",
    ),
    _four_bit(Feature.COMPILE, "bitsandbytes' 4-bit kernels are not compiled here", "use compile=False"),
    Refusal(
        Feature.ROUTER_LOSS,
        Feature.PIPELINE,
        UnsupportedSetupError,
        "the global batch's load-balancing loss needs every router; a pipeline stage holds only its own",
        "load the model with output_router_logits=False",
    ),
    Refusal(
        Feature.ROUTER_LOSS,
        Feature.CONTEXT,
        UnsupportedSetupError,
        "the global batch's load-balancing loss needs all of a row's tokens; a context-parallel part holds some",
        "load the model with output_router_logits=False",
    ),
    Refusal(
        Feature.DISTILLATION,
        Feature.PIPELINE,
        UnsupportedSetupError,
        "the KD loss needs each row's whole logits on its rank",
        "use pp_size=1",
    ),
    Refusal(
        Feature.DISTILLATION,
        Feature.CONTEXT,
        UnsupportedSetupError,
        "the KD loss needs each row's whole logits on its rank",
        "use cp_size=1",
    ),
    Refusal(
        Feature.PREFERENCE,
        Feature.PIPELINE,
        UnsupportedSetupError,
        "a pair's loss needs both its sequences' whole log-probabilities on one rank; a stage holds part of the model",
        "use pp_size=1",
    ),
    Refusal(
        Feature.PREFERENCE,
        Feature.CONTEXT,
        UnsupportedSetupError,
        "a pair's loss needs both its sequences' whole log-probabilities on one rank; a context-parallel part holds "
        "some of their tokens",
        "use cp_size=1",
    ),
    Refusal(
        Feature.FROZEN_MODEL,
        Feature.REPLICATED,
        UnsupportedSetupError,
        "DDP's first forward wants parameters that take gradients; a frozen model takes none, and under DDP every "
        "rank holds the whole model anyway",
        "load the frozen model with distributed_setup=None",
        unless=frozenset({Feature.TENSOR}),
    ),
)
"""Every combination refused, in the order their errors are reported."""


_ARGUMENT = {
    Feature.TENSOR: "tp_size",
    Feature.PIPELINE: "pp_size",
    Feature.CONTEXT: "cp_size",
    Feature.EXPERT: "ep_size",
}


def setup_arguments(setup: DistributedSetup) -> dict[Feature, str]:
    """The features a setup brings (its degrees above 1 and its strategy's traits), each named by
    the argument of ``DistributedSetup.build`` that asked for it."""
    degrees = setup.degrees
    sizes = {
        Feature.TENSOR: degrees.tp,
        Feature.PIPELINE: degrees.pp,
        Feature.CONTEXT: degrees.cp,
        Feature.EXPERT: degrees.ep,
    }
    arguments = {feature: f"{_ARGUMENT[feature]}={size}" for feature, size in sizes.items() if size > 1}
    if setup.sequence_parallel:
        arguments[Feature.SEQUENCE] = "sequence_parallel=True"
    return arguments | dict.fromkeys(setup.entry.traits, f"strategy={setup.strategy!r}")


def refusals(features: Iterable[Feature]) -> list[Refusal]:
    """The rows of :data:`REFUSALS` that refuse a job with ``features``."""
    present = set(features)
    return [refusal for refusal in REFUSALS if refusal.applies(present)]


def refuse_unsupported(where: str, arguments: Mapping[Feature, str]) -> None:
    """Raise the first refusal's error, naming every refused pair of ``arguments`` (feature → the
    argument that asked for it) with its reason and way out; return if all of them compose."""
    found = refusals(arguments)
    if found:
        raise found[0].error(f"{where}: " + "; ".join(refusal.describe(arguments) for refusal in found))
