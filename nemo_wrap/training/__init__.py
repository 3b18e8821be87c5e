"""What a user needs next to a sharded model to train it: the step, clipping, accumulation, data."""

from nemo_wrap.training.accumulation import no_gradient_sync
from nemo_wrap.training.clipping import clip_grad_norm_
from nemo_wrap.training.data import iterate_batches, read_token_windows
from nemo_wrap.training.evaluate import evaluate
from nemo_wrap.training.step import StepResult, train_step

__all__ = [
    "StepResult",
    "clip_grad_norm_",
    "evaluate",
    "iterate_batches",
    "no_gradient_sync",
    "read_token_windows",
    "train_step",
]
