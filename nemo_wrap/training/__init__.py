"""What a user needs next to a sharded model to train it: the step, clipping, accumulation, evaluation.

The data it trains on (rows, text windows, the data-parallel batches) is :mod:`nemo_wrap.data`.
"""

from nemo_wrap.training.accumulation import no_gradient_sync
from nemo_wrap.training.clipping import clip_grad_norm_
from nemo_wrap.training.distillation import (
    DistillationResult,
    DistillationSettings,
    distillation_step,
    freeze_teacher,
)
from nemo_wrap.training.evaluate import evaluate
from nemo_wrap.training.preference import (
    PreferenceResult,
    Reference,
    evaluate_preferences,
    preference_step,
    reference_for,
)
from nemo_wrap.training.preference_loss import PreferenceObjective, PreferenceSettings
from nemo_wrap.training.step import StepResult, train_step

__all__ = [
    "DistillationResult",
    "DistillationSettings",
    "PreferenceObjective",
    "PreferenceResult",
    "PreferenceSettings",
    "Reference",
    "StepResult",
    "clip_grad_norm_",
    "distillation_step",
    "evaluate",
    "evaluate_preferences",
    "freeze_teacher",
    "no_gradient_sync",
    "preference_step",
    "reference_for",
    "train_step",
]
