"""The learning rate at a step: linear warm-up, then constant or cosine decay to zero.

A pure function of the step, so a resumed run needs no scheduler state: the checkpoint's step is
enough.
"""

from __future__ import annotations

import math

from nemo_wrap.vocabulary import Vocabulary


class LearningRateSchedule(Vocabulary):
    """What the rate does after warm-up (``optimizer.lr_schedule``)."""

    COSINE = "cosine"  # decays to zero at the last step
    CONSTANT = "constant"


def learning_rate(
    step: int, peak: float, warmup_steps: int, total_steps: int, schedule: LearningRateSchedule | str
) -> float:
    """The rate for optimizer step ``step`` (0-based) of ``total_steps``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if LearningRateSchedule(schedule) is LearningRateSchedule.CONSTANT:
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
