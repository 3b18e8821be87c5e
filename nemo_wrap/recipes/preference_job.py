"""What a preference run (``training.objective`` dpo or simpo) puts into the one training loop.

:func:`~nemo_wrap.recipes.sft.run_sft` stays the loop — data, model, steps, evaluation,
checkpoints, faults — and takes from here the three things that differ: the rows (pairs, each a
``[2, max_length]`` row: :mod:`nemo_wrap.data.preferences`), the step
(:func:`~nemo_wrap.training.preference.preference_step`) and the held-out evaluation
(:func:`~nemo_wrap.training.preference.evaluate_preferences`: loss, reward accuracy and margin,
and how often the model prefers the chosen answer). The reference is made once and serves both.

A frozen copy, where the reference is one (full fine-tuning), is the run's own checkpoint loaded
again with the model's own load options but its adapters (:mod:`.frozen_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from nemo_wrap.data.preferences import load_preference_rows, pair_rows, prepare_pairs
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.recipes.config import DataSection
from nemo_wrap.recipes.frozen_model import load_frozen_model
from nemo_wrap.training.preference import (
    PreferenceResult,
    Reference,
    ReferenceSource,
    evaluate_preferences,
    preference_step,
    reference_for,
    reference_source,
)
from nemo_wrap.training.preference_loss import PreferenceSettings

Batch = dict[str, torch.Tensor]


def preference_rows(source: str, data: DataSection, tokenizer: Any, say: Callable[[str], None]) -> list[Batch]:
    """The pairs of ``source``, tokenized and labelled, one ``[2, max_length]`` row each."""
    rows = load_preference_rows(source, data.columns)
    prepared = prepare_pairs(rows, tokenizer, data.max_length)
    say(f"data: {source} (preference pairs, {rows.format.value}): {prepared.summary()}")
    return pair_rows(prepared.pairs, data.max_length, tokenizer.pad_token_id or 0)


def preference_reference(
    model: Any,
    settings: PreferenceSettings,
    checkpoint: str | Path,
    load: tuple[DistributedSetup, LoadOptions],
    say: Callable[[str], None],
) -> Reference:
    """The run's reference (module docstring), said once; ``load``: the model's setup and load
    options, which a frozen copy shares (its precision and loss path)."""
    setup, options = load
    source = reference_source(settings, model.nemo_state.lora_config)
    frozen = None
    if source is ReferenceSource.FROZEN_COPY:  # the starting model: the policy's load without its adapters
        frozen = load_frozen_model(checkpoint, setup, replace(options, peft_config=None, adapter=None, compile=False))
    say(f"{settings.objective.value}: reference = {source.value}")
    return reference_for(model, settings, frozen)


def preference_step_function(
    model: Any,
    optimizer: torch.optim.Optimizer,
    settings: PreferenceSettings,
    reference: Reference,
    max_grad_norm: float | None,
) -> Callable[[Sequence[Batch]], PreferenceResult]:
    """One optimizer step of the objective on a step's micro-batches of pairs."""

    def step(micro_batches: Sequence[Batch]) -> PreferenceResult:
        return preference_step(model, optimizer, micro_batches, settings, reference, max_grad_norm)

    return step


def preference_evaluation(
    model: Any, micro_batches: Sequence[Batch], settings: PreferenceSettings, reference: Reference
) -> Callable[[], dict[str, float]]:
    """The held-out preference metrics over every rank's held-out ``micro_batches``."""
    return lambda: evaluate_preferences(model, micro_batches, settings, reference)
