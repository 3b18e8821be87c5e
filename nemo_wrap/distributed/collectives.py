"""Making every rank act together: who is in a multi-rank job, and failing on all ranks at once.

A step that raises on one rank while the others go on to the next collective leaves them waiting
forever. Each helper here runs a step and then exchanges its outcome, so all ranks return or all
raise — the failing rank with its own error, the others with an error that points to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from nemo_wrap.errors import NeMoWrapError, RemoteRankError

T = TypeVar("T")


def is_multi_rank() -> bool:
    """Whether a process group of more than one rank exists (collectives have partners)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def collective_device() -> torch.device:
    """Where small tensors for collectives live: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_memory_bytes(device: torch.device) -> int:
    """The total memory of ``device``: the GPU's own, or this host's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class RankGroup:
    """Who takes part in a step: every rank of the job together, or this process alone.

    A model loaded without a ``DistributedSetup`` is process-local: loading, saving and verifying it
    run no collective, whatever process group exists — the rank-0 idiom (one rank loads, evaluates
    and saves while the others wait elsewhere) must not hang. A sharded model's steps are collective.
    """

    collective: bool
    process_group: dist.ProcessGroup | None = None  # None: every rank of the job

    @classmethod
    def job(cls) -> RankGroup:
        """Every rank of the job (collective when there is more than one)."""
        return cls(is_multi_rank())

    @classmethod
    def local(cls) -> RankGroup:
        """This process alone."""
        return cls(False)

    @classmethod
    def of(cls, sharded: bool) -> RankGroup:
        """The job for a sharded model, this process alone for a process-local one."""
        return cls.job() if sharded else cls.local()

    @classmethod
    def of_ranks(cls, process_group: dist.ProcessGroup) -> RankGroup:
        """The ranks of ``process_group`` (one pipeline stage's ranks, say), collective among them."""
        return cls(dist.get_world_size(process_group) > 1, process_group)

    @property
    def rank(self) -> int:
        """This process's rank within the group (0 for a process-local group)."""
        return dist.get_rank(self.process_group) if self.collective else 0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.process_group) if self.collective else 1

    @property
    def first_global_rank(self) -> int:
        """The job-wide rank of the group's rank 0."""
        if not self.collective:
            return dist.get_rank() if dist.is_initialized() else 0
        return dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0

    @property
    def is_writer(self) -> bool:
        """Whether this process does the group's single-writer work (rank 0, or the only process)."""
        return self.rank == 0

    def on_every_rank(self, what: str, action: Callable[[], T]) -> T:
        """Run ``action`` here; in a collective group, if it fails on any rank, fail on every rank.

        A failing rank re-raises its own error; the others raise :class:`RemoteRankError`. Costs one
        small all-reduce, and only in a collective group.
        """
        error: Exception | None = None
        result = None
        try:
            result = action()
        except Exception as caught:  # re-raised below, unchanged
            error = caught
        if self.collective:
            failed = torch.tensor([0 if error is None else 1], device=collective_device())
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.process_group)
            if failed.item() and error is None:
                raise RemoteRankError(f"another rank failed while {what}; its error is in that rank's output")
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    def on_rank_zero(
        self,
        what: str,
        action: Callable[[], T],
        failure: Callable[[str], NeMoWrapError],
        passed: tuple[type[NeMoWrapError], ...] = (),
    ) -> T:
        """Run ``action`` on the writer alone and return its (small, picklable) result on every rank.

        If it raises, every rank raises ``failure(description)``, where the description names the
        step and the writer's error; on the writer it is chained to the original error. An error of
        a class in ``passed`` (the writer's verdict, already worded for the user) is raised as it is
        on every rank instead: the same class and message.
        """
        error: Exception | None = None
        outcome: list[object] = [None, None, None]  # [error text or None, result, a passed error or None]
        if self.is_writer:
            try:
                outcome[1] = action()
            except passed as verdict:  # handed to every rank as it is
                outcome[2] = verdict
            except Exception as caught:  # reported on every rank below
                error = caught
                outcome[0] = f"{type(caught).__name__}: {caught}"
        if self.collective:
            dist.broadcast_object_list(outcome, src=self.first_global_rank, group=self.process_group)
        if isinstance(outcome[2], NeMoWrapError):
            raise outcome[2]
        if outcome[0] is not None:
            raise failure(f"{what} failed on rank 0: {outcome[0]}") from error
        return outcome[1]  # type: ignore[return-value]
