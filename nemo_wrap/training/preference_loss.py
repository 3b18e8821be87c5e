"""The preference objectives: each pair's loss and rewards from its sequences' log-probabilities.

A preference batch holds ``2n`` sequences, chosen and rejected alternating (rows ``2i`` and
``2i + 1`` are pair ``i``; :func:`nemo_wrap.data.preferences.pair_rows`). Every objective reads a
sequence by the sum of its completion tokens' log-probabilities (:class:`SequenceScores`), as TRL's
trainers do, and is written here once, for the full-logits path and the chunked one alike.

- ``dpo`` — Direct Preference Optimization (Rafailov et al., 2023), TRL's ``loss_type="sigmoid"``:
  with ``h = (log π(c) − log π(r)) − (log π_ref(c) − log π_ref(r))``,
  ``loss = −(1 − ε) · log σ(β h) − ε · log σ(−β h)`` (``ε``: label smoothing, the conservative
  DPO of Mitchell, 2023). Rewards: ``β (log π − log π_ref)`` of each completion.
- ``simpo`` — SimPO (Meng, Xia & Chen, 2024), reference-free, TRL's ``CPOTrainer`` with
  ``loss_type="simpo"`` and ``cpo_alpha=0``: each completion is scored by its *mean* token
  log-probability, ``h = mean log π(c) − mean log π(r) − γ/β``, the same smoothed sigmoid loss.
  Rewards: ``β · mean log π`` of each completion. No reference model at all.

A pair with no completion token in either sequence is padding (a rank short of pairs gets such
rows): it adds no loss, no reward and is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from nemo_wrap.errors import InvalidSetupError


class PreferenceObjective(Enum):
    """What a preference step optimizes (the recipe's ``training.objective``)."""

    DPO = "dpo"
    SIMPO = "simpo"

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares the policy with a frozen reference model."""
        return self is PreferenceObjective.DPO


@dataclass(frozen=True)
class PreferenceSettings:
    """An objective and its constants, TRL's names and defaults (``beta=0.1``, ``simpo_gamma=0.5``;
    the SimPO paper tunes ``beta`` far higher, 2.0-2.5). ``label_smoothing`` smooths either
    objective's sigmoid loss (conservative DPO)."""

    objective: PreferenceObjective = PreferenceObjective.DPO
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise InvalidSetupError(f"beta={self.beta!r}: must be a finite number > 0")
        if not 0.0 <= self.label_smoothing < 0.5:  # NaN fails here too
            raise InvalidSetupError(f"label_smoothing={self.label_smoothing!r}: must lie in [0, 0.5)")
        if not math.isfinite(self.simpo_gamma):
            raise InvalidSetupError(f"simpo_gamma={self.simpo_gamma!r}: must be a finite number")


@dataclass(frozen=True)
class SequenceScores:
    """Per sequence of a preference batch: the sum of its completion tokens' log-probabilities
    and how many completion tokens it has (``[2n]`` each, chosen and rejected alternating)."""

    log_probs: torch.Tensor
    tokens: torch.Tensor

    def mean_log_probs(self) -> torch.Tensor:
        return self.log_probs / self.tokens.clamp(min=1)


@dataclass(frozen=True)
class PairTerms:
    """Per pair: the loss and the two completions' rewards (zero for a padding pair)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_terms(settings: PreferenceSettings, policy: SequenceScores, reference: torch.Tensor | None) -> PairTerms:
    """Each pair's loss and rewards (module docstring); ``reference``: the reference model's
    log-probability sums of the same sequences, for an objective that needs one."""
    if settings.objective is PreferenceObjective.SIMPO:
        scores = objective_scores(settings, policy)
        margin = scores[0::2] - scores[1::2] - settings.simpo_gamma / settings.beta
        rewards = settings.beta * scores.detach()
    else:
        if reference is None:
            raise InvalidSetupError("dpo compares the policy with a reference model's log-probabilities; none given")
        ratios = policy.log_probs - reference
        margin = ratios[0::2] - ratios[1::2]
        rewards = settings.beta * ratios.detach()
    smoothing = settings.label_smoothing
    losses = -(1 - smoothing) * F.logsigmoid(settings.beta * margin) - smoothing * F.logsigmoid(-settings.beta * margin)
    real = real_pairs(policy.tokens).to(losses.dtype)
    return PairTerms(losses * real, rewards[0::2] * real, rewards[1::2] * real)


def objective_scores(settings: PreferenceSettings, scores: SequenceScores) -> torch.Tensor:
    """Each sequence's log-probability as the objective reads it: summed over its completion
    tokens (dpo), or their mean (simpo); TRL logs these as ``logps/chosen`` and ``logps/rejected``."""
    if settings.objective is PreferenceObjective.SIMPO:
        return scores.mean_log_probs()
    return scores.log_probs


def real_pairs(tokens: torch.Tensor) -> torch.Tensor:
    """Which pairs of a batch are real, from each sequence's completion-token count: both
    sequences have some (a padding pair has none; a pair with one empty side compares nothing)."""
    return (tokens[0::2] > 0) & (tokens[1::2] > 0)
