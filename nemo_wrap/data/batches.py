"""Micro-batches for one data-parallel rank, epoch after epoch, resumable from a checkpoint.

Every rank takes the same number of steps: when the rows do not divide, a rank short of rows gets
a padding row (nothing to learn) instead, so no rank waits in a collective the others skipped.
``state_dict`` / ``load_state_dict`` make it a ``Stateful`` that
:func:`nemo_wrap.checkpoint.resume.save_checkpoint` stores with the model, so a resumed run sees
exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nemo_wrap.data.labels import IGNORE_INDEX
from nemo_wrap.data.order import epoch_order
from nemo_wrap.errors import TrainingDataError

Batch = dict[str, torch.Tensor]


class DataParallelBatches:
    """Steps of ``accumulation`` micro-batches of ``micro_batch_size`` rows for rank ``dp_rank``.

    Iterating yields one step (a list of micro-batches) at a time, endlessly. Over all ranks a step
    holds the next ``micro_batch_size * accumulation * dp_size`` rows of the epoch's permutation,
    whatever ``dp_size`` is: a run on one rank and the same global batch on several train on the
    same rows at every step, so their losses can be compared step by step.
    """

    def __init__(
        self,
        rows: Sequence[Batch],
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        accumulation: int = 1,
    ) -> None:
        if not rows:
            raise TrainingDataError("no rows to train on")
        _check_layout(micro_batch_size, dp_rank, dp_size, accumulation)
        self.rows, self.micro_batch_size, self.accumulation = rows, micro_batch_size, accumulation
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.epoch, self.step_in_epoch = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        per_rank = math.ceil(len(self.rows) / self.dp_size)
        return math.ceil(per_rank / (self.micro_batch_size * self.accumulation))

    def __iter__(self) -> Iterator[list[Batch]]:
        while True:
            order = epoch_order(len(self.rows), self.seed, self.epoch, self.dp_rank, self.dp_size)
            per_step = self.micro_batch_size * self.accumulation
            while self.step_in_epoch < self.steps_per_epoch:
                chosen = order[self.step_in_epoch * per_step : (self.step_in_epoch + 1) * per_step]
                self.step_in_epoch += 1
                yield self._micro_batches(chosen)
            self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def rest_of_epoch(self) -> list[list[Batch]]:
        """The steps left in the current epoch (all of them for a fresh object), advancing to its end."""
        remaining = self.steps_per_epoch - self.step_in_epoch
        return [step for _, step in zip(range(remaining), self, strict=False)]

    def _micro_batches(self, chosen: list[int]) -> list[Batch]:
        rows = [self.rows[i] for i in chosen]
        rows += [_padding_row(self.rows[0])] * (self.micro_batch_size * self.accumulation - len(rows))
        size = self.micro_batch_size
        return [_stack(rows[i : i + size]) for i in range(0, len(rows), size)]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "seed": self.seed, "rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (int(state["seed"]), int(state["rows"])) != (self.seed, len(self.rows)):
            raise TrainingDataError(
                f"the checkpoint's data position is for seed {int(state['seed'])} over {int(state['rows'])} rows; "
                f"this run has seed {self.seed} over {len(self.rows)} rows: resuming would see other batches"
            )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


def _check_layout(micro_batch_size: int, dp_rank: int, dp_size: int, accumulation: int) -> None:
    """Refuses at construction what would otherwise fail only once iterated (an empty step divides by
    zero) or train silently wrong (a ``dp_rank`` outside the group is dealt nothing but padding)."""
    if micro_batch_size < 1 or accumulation < 1:
        raise TrainingDataError(
            f"micro_batch_size={micro_batch_size} and accumulation={accumulation} must both be at least 1"
        )
    if not 0 <= dp_rank < dp_size:
        raise TrainingDataError(f"dp_rank={dp_rank} is not one of the dp_size={dp_size} data-parallel ranks")


def _padding_row(like: Batch) -> Batch:
    return {
        "input_ids": torch.zeros_like(like["input_ids"]),
        "labels": torch.full_like(like["labels"], IGNORE_INDEX),
        "position_ids": like["position_ids"].clone(),
    }


def _stack(rows: list[Batch]) -> Batch:
    return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
