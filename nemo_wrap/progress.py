"""Progress bars for long work (loading, saving), shown the way transformers shows its own.

A multi-gigabyte load or save on several ranks must not look like a hang. One bar, on the rank that
speaks for the job (rank 0, or a process on its own), counting tensors with their rate. It is shown
when the output is a terminal or a notebook, never when transformers' bars are disabled
(``transformers.utils.logging.disable_progress_bar``); ``NEMO_WRAP_PROGRESS=0`` turns it off and
``NEMO_WRAP_PROGRESS=1`` on, whatever the output.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging


def progress_enabled(speaks_for_the_job: bool) -> bool:
    """Whether this process shows bars now (see the module docstring)."""
    setting = os.environ.get("NEMO_WRAP_PROGRESS")
    if not speaks_for_the_job or setting == "0" or not transformers_logging.is_progress_bar_enabled():
        return False
    return setting == "1" or sys.stderr.isatty() or "ipykernel" in sys.modules


def progress_bar(total: int, description: str, speaks_for_the_job: bool, unit: str = "tensor") -> Any:
    """A tqdm bar over ``total`` tensors (or other ``unit``), disabled (a no-op) where bars are off."""
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        disable=not progress_enabled(speaks_for_the_job),
        leave=False,
        file=sys.stderr,
    )
