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
from nemo_wrap.training.step import StepResult, train_step

__all__ = [
    "DistillationResult",
    "DistillationSettings",
    "StepResult",
    "clip_grad_norm_",
    "distillation_step",
    "evaluate",
    "freeze_teacher",
    "no_gradient_sync",
    "train_step",
]
