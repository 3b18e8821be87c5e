"""Stopping a run cleanly when its machines are taken back: SIGTERM → finish the step, checkpoint, exit 75.

SLURM (at a time limit or a preemption) and Kubernetes (evicting a pod) send SIGTERM, wait a grace
period (SLURM's ``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``; torchrun's agent, which
forwards the signal to its workers, 30 s) and then SIGKILL. Everything trained since the last
checkpoint is lost unless the run saves at once. So while a run runs a SIGTERM only
records a request (:func:`stop_requests`); at fixed points (before the first step, after each step,
after the final save) every rank learns whether *any* rank was
asked (:meth:`StopRequest.agreed`, one one-element all-reduce), so a signal that reached one rank
stops all of them after the same step — a checkpoint is a collective, and ranks that stopped at
different steps would wait for each other forever. The loop then writes a resumable checkpoint and
raises :class:`nemo_wrap.errors.PreemptedError`; the command line exits with
:data:`PREEMPTED_EXIT_STATUS`, sysexits' ``EX_TEMPFAIL`` ("try again"), so a scheduler or a script
can tell "stopped on request: rerun with ``--resume auto``" from a failure (status 1 or 2).

A second SIGTERM exits at once, by the signal's default action (the process dies of SIGTERM, as it
would have without the handler): for when the checkpoint is not wanted or takes too long. Copies that
arrive within :data:`REPEAT_GRACE_S` of the first count as the same request, because under SLURM
every process of the job receives the signal *and* torchrun's agent forwards its own copy to each
worker, milliseconds apart.

The handler is installed for a whole run — from reading its data to the end of its final save — and
the previous one is restored after: importing nemo_wrap changes no signal disposition. What a
request costs depends on when it comes (the table in ``docs/how-to/faults.md``): before the first step
the run stops at the next phase boundary with nothing to save; during a step, its evaluation or
its periodic save, that unit is finished and one checkpoint written; after the last step the
closing evaluation and the final save are finished, and the run is complete.
A rank that cannot run (stopped, or stuck inside one call) does not act on a SIGTERM
either way — measured here, a SIGSTOPped process outlives one with or without a handler — so
torchrun kills such a rank with SIGKILL after its stop grace (30 s).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import torch
import torch.distributed as dist

from nemo_wrap.distributed.collectives import RankGroup, collective_device

PREEMPTED_EXIT_STATUS = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the same command may be run again
REPEAT_GRACE_S = 2.0  # SIGTERMs this close to the first are copies of it, not a second request


class StopRequest:
    """Whether this process was asked to stop (its SIGTERM handler), and whether the job agrees to."""

    def __init__(self) -> None:
        self.signalled_at: float | None = None  # time.monotonic() of the first SIGTERM

    @property
    def requested(self) -> bool:
        """Whether this process received a SIGTERM while the run ran."""
        return self.signalled_at is not None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: the first SIGTERM is a request, a later one (past the grace) kills."""
        now = time.monotonic()
        if self.signalled_at is None:
            self.signalled_at = now
        elif now - self.signalled_at >= REPEAT_GRACE_S:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def agreed(self) -> bool:
        """Whether any rank of the job was asked to stop. Collective: every rank calls it at the same
        points (see above) and gets the same answer (one one-element all-reduce; none in one rank)."""
        flag = torch.tensor([1 if self.requested else 0], device=collective_device())
        if RankGroup.job().collective:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """SIGTERM recorded as a :class:`StopRequest` inside the block; the previous handler restored after.

    Python runs signal handlers in the main thread only: called from another thread this installs
    nothing, and the request is never made.
    """
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = signal.signal(signal.SIGTERM, request.handle)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
