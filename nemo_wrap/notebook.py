"""Several ranks from one notebook cell: ``launch(function, nproc, ...)`` returns rank 0's value.

Each rank is a fresh interpreter (``python -m nemo_wrap.notebook``), not a fork of the kernel:
forking a process that has run torch's thread pools can hang the child (seen here), and a kernel
that already ran ``initialize_distributed()`` would hand its process group to every child.
accelerate's ``notebook_launcher`` forks, and hands nothing back. The function — defined in a cell,
so not importable — travels by value (``cloudpickle``), with its arguments. Every rank runs it
inside ``initialize_distributed()`` / ``destroy_distributed()`` on a free local port (gloo on CPU,
nccl with CUDA). Rank 0's output is streamed into the cell as it comes (prints and progress bars);
the other ranks are quiet unless they fail. The first rank to fail, a ``timeout`` or an interrupt
(the kernel's stop button) ends every rank — their whole process group — and raises one
:class:`LaunchError` in the cell, carrying the failing rank's traceback. A rank killed by a signal
(an abort in C++ code, a segmentation fault) has no Python traceback of its own: the error then
says which signal, whether the rank's function had returned, and where each of its Python threads
was (``faulthandler``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from nemo_wrap.errors import LaunchError
from nemo_wrap.validation import require_positive_int

_POLL_S = 0.05
_FAILURE_GRACE_S = 1.0


def launch(function: Callable[..., Any], nproc: int, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` on ``nproc`` local ranks; return rank 0's return value."""
    require_positive_int(nproc, "nproc", LaunchError)
    with tempfile.TemporaryDirectory(prefix="nemo_wrap_launch_") as workdir:
        work = Path(workdir)
        (work / "job.pkl").write_bytes(cloudpickle.dumps((function, args, kwargs)))
        port = _free_port()
        ranks: list[_Rank] = []
        try:
            ranks += [_start_rank(rank, nproc, port, work) for rank in range(nproc)]
            _wait(ranks, timeout)
        finally:
            for rank in ranks:
                rank.stop()
        return cloudpickle.loads((work / "result-0.pkl").read_bytes())


class _Rank:
    """One rank's process, and the thread that forwards rank 0's output into the cell."""

    def __init__(self, rank: int, process: subprocess.Popen[bytes], work: Path) -> None:
        self.rank, self.process, self.work = rank, process, work
        self.forwarder = threading.Thread(target=self._forward, daemon=True) if rank == 0 else None
        if self.forwarder is not None:
            self.forwarder.start()

    def _forward(self) -> None:
        assert self.process.stdout is not None
        descriptor = self.process.stdout.fileno()
        for chunk in iter(lambda: os.read(descriptor, 4096), b""):  # as it comes, not line by line
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()

    def failure(self) -> tuple[float, str]:
        """When this rank failed (its own clock) and its traceback. A rank killed by a signal failed
        when faulthandler wrote its threads (the file's modification time): a peer that fails
        because of it, a moment later, must not be taken for the first."""
        path, faults = self.work / f"error-{self.rank}.txt", self._faults
        if path.is_file():
            when, _, text = path.read_text().partition("\n")
            return float(when), text
        written = faults.is_file() and faults.stat().st_size > 0
        return (faults.stat().st_mtime if written else time.time()), self._exit_without_traceback()

    @property
    def _faults(self) -> Path:
        """Where faulthandler writes the rank's threads when a signal kills it (see :func:`_run_rank`)."""
        return self.work / f"fault-{self.rank}.txt"

    def _exit_without_traceback(self) -> str:
        """A rank that ended without writing its traceback: killed by a signal, or exited early."""
        code = self.process.returncode
        status = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        returned = (self.work / f"returned-{self.rank}").is_file()
        phase = "after its function had returned" if returned else "while its function ran"
        lines = self._faults.read_text().splitlines() if self._faults.is_file() else []
        threads = "\n".join(line for line in lines if not line.startswith("Extension modules:")).strip()
        return f"{status}, {phase}" + (f"; its Python threads then:\n{threads}" if threads else "")

    def stop(self) -> None:
        """End the rank and everything it started, then reap it: no orphan, no bound port."""
        if self.process.poll() is None:
            for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.forwarder is not None:
            self.forwarder.join(timeout=5)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_rank(rank: int, nproc: int, port: int, work: Path) -> _Rank:
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }
    quiet = subprocess.DEVNULL if rank else subprocess.PIPE
    process = subprocess.Popen(
        [sys.executable, "-m", "nemo_wrap.notebook", str(work), str(rank)],
        env=env,
        stdout=quiet,
        stderr=subprocess.STDOUT if rank == 0 else subprocess.DEVNULL,
        start_new_session=True,  # its own process group: stopping it stops what it started
    )
    return _Rank(rank, process, work)


def _wait(ranks: list[_Rank], timeout: float | None) -> None:
    """Until every rank exits 0; raise at the first failure, the timeout, or an interrupt."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [rank.process.poll() for rank in ranks]
        failed = [rank for rank, code in zip(ranks, codes, strict=True) if code not in (None, 0)]
        if failed:
            raise _first_failure(ranks)
        if all(code == 0 for code in codes):
            return
        if deadline is not None and time.monotonic() > deadline:
            raise LaunchError(f"the job did not finish within timeout={timeout} s; every rank was stopped")
        time.sleep(_POLL_S)


def _first_failure(ranks: list[_Rank]) -> LaunchError:
    """The rank that failed first: the others usually fail *because* it did (a peer's connection
    reset in a collective), a moment later. Their errors get a moment to land, then the earliest wins."""
    time.sleep(_FAILURE_GRACE_S)
    failures = [(rank.failure(), rank.rank) for rank in ranks if rank.process.poll() not in (None, 0)]
    (_, traceback_text), rank = min(failures)
    return LaunchError(f"rank {rank} of {len(ranks)} failed:\n{traceback_text}")


def _run_rank(work: Path, rank: int) -> int:
    """A rank's body: the function inside the process group; rank 0's value or the traceback to
    files. The traceback is written the moment the function fails — before the group is torn
    down, which is what makes the other ranks fail — so the first failure has the earliest time."""
    import traceback

    from nemo_wrap.distributed import destroy_distributed, initialize_distributed

    # open for the process's life: a fatal signal writes every thread's stack into it
    faulthandler.enable(os.open(work / f"fault-{rank}.txt", os.O_WRONLY | os.O_CREAT), all_threads=True)
    try:
        function, args, kwargs = cloudpickle.loads((work / "job.pkl").read_bytes())
        initialize_distributed()
        result = function(*args, **kwargs)
        if rank == 0:
            (work / "result-0.pkl").write_bytes(cloudpickle.dumps(result))
        (work / f"returned-{rank}").touch()
        destroy_distributed()
        return 0
    except BaseException:
        (work / f"error-{rank}.txt").write_text(f"{time.time()}\n{traceback.format_exc()}")
        return 1


if __name__ == "__main__":
    sys.exit(_run_rank(Path(sys.argv[1]), int(sys.argv[2])))
