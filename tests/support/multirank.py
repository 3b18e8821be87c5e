"""Run test bodies on N real CPU ranks (gloo), many cases per launch.

Why a pool: a fresh 2-rank launch costs ~15 s here (interpreter start, ``import torch``,
rendezvous), and the suite has on the order of a hundred multi-rank cases. A :class:`RankPool`
starts N spawned processes once, initializes a real gloo process group among them through a
``file://`` store in a fresh temp dir (no port races), and then ships each case — a module-level
function, pickled by reference — to every rank. pytest still reports every case on its own because
each test function calls :meth:`RankPool.run` once.

Failure handling is what makes the pool safe to share:
- a case that raises on any rank fails with *that rank's* traceback in the report;
- a case that does not finish on every rank within ``timeout`` seconds fails, naming the ranks
  that hung, instead of stalling CI;
- after any failure the pool is torn down and restarted for the next case, because a rank that
  raised mid-collective leaves the others blocked or the group out of step.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

DEFAULT_CASE_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 120.0
# How long the other ranks get to finish once one rank has failed: they are usually stuck in a
# collective that the failed rank never joined, so this only needs to cover ranks still computing.
FAILURE_GRACE_S = 5.0


class RankCaseError(AssertionError):
    """A multi-rank case failed: raised on some rank, hung, or a rank process died."""


def _rank_main(rank: int, world_size: int, init_file: str, conn: Connection) -> None:
    """Body of one rank process: join the gloo group, then run cases until told to stop."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import traceback

    import torch
    import torch.distributed as dist

    # N ranks share 2 cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=600),
    )
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            outcome = ("ok", fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - every failure must reach the report
            outcome = ("error", traceback.format_exc())
        try:
            conn.send(outcome)
        except Exception:  # the result itself did not pickle
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """N rank processes joined in one gloo process group, reused across test cases."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._connections: list[Connection] = []
        self._tmpdir: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="nemo_wrap_ranks_")
        init_file = os.path.join(self._tmpdir, "rendezvous")
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(rank, self.world_size, init_file, child_end),
                name=f"nemo_wrap-rank{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._processes.append(process)
            self._connections.append(parent_end)
        replies = self._collect(STARTUP_TIMEOUT_S, what="start-up")
        failed = {rank: reply for rank, reply in replies.items() if reply[0] != "ready"}
        if failed or len(replies) < self.world_size:
            self.close()
            raise RankCaseError(self._describe(replies, "start-up", STARTUP_TIMEOUT_S))

    def close(self) -> None:
        """Stop every rank: politely when they are idle, by force when they are not."""
        for connection in self._connections:
            try:
                connection.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for connection in self._connections:
            connection.close()
        self._processes, self._connections = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- running cases -----------------------------------------------------------------------
    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = DEFAULT_CASE_TIMEOUT_S,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be a module-level function (it is pickled by reference). Raises
        :class:`RankCaseError` with the failing ranks' tracebacks, or the hung ranks' numbers.
        """
        if not self._processes:
            self._start()
        for connection in self._connections:
            connection.send((fn, args, kwargs))
        replies = self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))
        if len(replies) == self.world_size and all(kind == "ok" for kind, _ in replies.values()):
            return [replies[rank][1] for rank in range(self.world_size)]
        self.close()  # a failed case leaves the group unusable: restart for the next one
        raise RankCaseError(self._describe(replies, getattr(fn, "__qualname__", "case"), timeout))

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        """Gather one reply per rank; stop early (after a grace period) once any rank failed."""
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self._connections))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for connection in wait(list(pending.values()), timeout=remaining):
                rank = next(r for r, c in pending.items() if c is connection)
                del pending[rank]
                try:
                    replies[rank] = connection.recv()
                except EOFError:
                    exitcode = self._processes[rank].exitcode
                    replies[rank] = ("error", f"rank process died (exit code {exitcode})")
                if replies[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return replies

    def _describe(self, replies: dict[int, tuple[str, Any]], what: str, timeout: float) -> str:
        lines = [f"{what} failed on {self.world_size} ranks:"]
        for rank in range(self.world_size):
            if rank not in replies:
                lines.append(f"--- rank {rank}: no answer (hung, or waiting on a failed rank; limit {timeout:.0f} s)")
            elif replies[rank][0] == "error":
                lines.append(f"--- rank {rank} raised:\n{replies[rank][1]}")
        return "\n".join(lines)
