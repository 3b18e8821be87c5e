"""What a user needs next to a sharded model to train it: the step, clipping, accumulation, data."""

from nemo_wrap.training.accumulation import no_gradient_sync
from nemo_wrap.training.clipping import clip_grad_norm_
from nemo_wrap.training.data import iterate_batches, read_token_windows, window_rows
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
    "iterate_batches",
    "no_gradient_sync",
    "read_token_windows",
    "train_step",
    "window_rows",
]
