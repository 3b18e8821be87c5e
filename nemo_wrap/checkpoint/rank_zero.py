"""Filesystem work done by rank 0 alone, with every rank learning its outcome.

A checkpoint directory is created, renamed and (for the consolidated format) written by one
process, while the other ranks go on to the next collective. If rank 0 failed and raised alone,
the others would wait in that collective forever. So after each such step rank 0 broadcasts
success (with the step's small result) or the error's text, and every rank returns or raises
:class:`CheckpointSaveError` together.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from nemo_wrap.errors import CheckpointSaveError

T = TypeVar("T")


class RankZeroSteps:
    """Runs steps on rank 0 (or the only process) and makes their outcome every rank's outcome.

    ``collective=False`` means no other rank takes part: the steps run here, without broadcasts.
    """

    def __init__(self, directory: Path, collective: bool) -> None:
        self.directory = directory
        self.collective = collective

    @property
    def is_writer(self) -> bool:
        """Whether this process performs the steps (rank 0, or the only process)."""
        return not self.collective or dist.get_rank() == 0

    def run(self, what: str, action: Callable[[], T]) -> T:
        """``action()`` on the writer; its result (small and picklable) is returned on every rank.

        Raises :class:`CheckpointSaveError` naming the directory, the step and rank 0's error on
        every rank if the action raised (chained to the original error on rank 0).
        """
        error: Exception | None = None
        outcome: list = [None, None]  # [error text or None, result]
        if self.is_writer:
            try:
                outcome[1] = action()
            except Exception as caught:  # noqa: BLE001 - reported on every rank below
                error = caught
                outcome[0] = f"{type(caught).__name__}: {caught}"
        if self.collective:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise CheckpointSaveError(f"{self.directory}: {what} failed on rank 0: {outcome[0]}") from error
        return outcome[1]
