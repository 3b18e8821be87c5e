"""Process-group bootstrap that behaves the same under torchrun and in a notebook kernel.

Under torchrun the launcher exports ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and we
join the default group through ``env://`` — on one node with a store of each attempt instead, so
a job restarted by ``--max-restarts`` does not meet its previous attempt (:func:`_attempt_store`).
Across nodes no attempt number is shared, so restarts there need a store of each attempt from the
launcher, and a launch that would hang at its first restart is refused up front
(:func:`_require_restartable_launch`).
With no launcher (plain ``python``, a Jupyter kernel)
we make a world of one on a TCP store bound to port 0, so the OS picks a free port atomically and
two notebooks on one machine never collide. Re-running the cell that calls
:func:`initialize_distributed` must be harmless, so an initialized group is never re-initialized:
the existing one is described and returned.

``timeout_s`` bounds every collective: a rank that stops answering (hung, stopped, cut off) makes
the others' next collective fail after that long instead of waiting forever. gloo (torch 2.13)
reports it as a plain ``RuntimeError`` — the class it also uses for a peer whose connection closed
(raised at once) and for any other failure — so the class alone cannot say "timeout", and messages
are not matched. :func:`peers_must_answer` uses what defines a timeout instead: the failing block
waited at least the timeout. Such an error becomes :class:`PeerTimeoutError`, naming what was
waiting, this rank and the timeout, with the backend's message appended; any other error passes
through unchanged — unless another rank has vanished: a rank that dies makes gloo fail the
others' collective at once, and :mod:`.liveness` (every rank's heartbeat in the job's store) tells
which rank stopped beating; that error becomes :class:`PeerLostError` naming it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_wrap.distributed.liveness import Heartbeat, StoreGoneError
from nemo_wrap.errors import DistributedStateError, NeMoWrapError, PeerLostError, PeerTimeoutError

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SUPPORTED_BACKENDS = ("gloo", "nccl")

# The store of a single-process world must outlive the call that created it.
_single_process_store: dist.TCPStore | None = None
# The collective timeout of the group initialize_distributed created (None: none, or made elsewhere).
_timeout_s: float | None = None
# This rank's heartbeat in a job launched by torchrun (None: no peers to lose, or a group made elsewhere).
_heartbeat: Heartbeat | None = None


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main_process(self) -> bool:
        """Rank 0: the process that logs, downloads and prints reports."""
        return self.rank == 0


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _launched_by_torchrun() -> bool:
    return all(name in os.environ for name in _LAUNCHER_VARIABLES)


def _describe_current_group() -> DistributedEnv:
    backend = str(dist.get_backend())
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistributedEnv(rank, dist.get_world_size(), local_rank, device, backend)


def initialize_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> DistributedEnv:
    """Join (or create) the default process group and describe this process's place in it.

    ``backend=None`` picks ``nccl`` when CUDA is available, else ``gloo``. Idempotent: when a
    group already exists (a re-run notebook cell, a test harness, a caller that initialized torch
    itself) it is returned as is, and asking for a different backend than the one running raises
    :class:`DistributedStateError` rather than silently ignoring the request.
    """
    if backend is not None and backend not in _SUPPORTED_BACKENDS:
        raise DistributedStateError(
            f"initialize_distributed(backend={backend!r}): expected one of {_SUPPORTED_BACKENDS} or None"
        )
    if dist.is_initialized():
        env = _describe_current_group()
        if backend is not None and backend != env.backend:
            raise DistributedStateError(
                f"initialize_distributed(backend={backend!r}): the process group is already "
                f"initialized with backend {env.backend!r}; call destroy_distributed() first"
            )
        return env

    backend = backend or _default_backend()
    timeout = timedelta(seconds=timeout_s)
    global _single_process_store, _timeout_s
    if _launched_by_torchrun():
        _require_restartable_launch()
    attempt_store = _attempt_store(timeout) if _launched_by_torchrun() else None
    if attempt_store is not None:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=attempt_store, rank=rank, world_size=world_size, timeout=timeout)
    elif _launched_by_torchrun():
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        _single_process_store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        dist.init_process_group(backend, store=_single_process_store, rank=0, world_size=1, timeout=timeout)
    _timeout_s = timeout_s
    env = _describe_current_group()
    if _launched_by_torchrun() and env.world_size > 1:
        global _heartbeat
        _heartbeat = Heartbeat(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.rank, env.world_size)
        _heartbeat.start()
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    return env


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """The store of this attempt of a single-node torchrun job whose agent shares its store with the
    ranks; ``None`` (use ``env://``) otherwise.

    torchrun 2.13 (c10d rendezvous) keeps one store for every attempt of a job (``--max-restarts``)
    and its ranks join it with no per-attempt prefix, so a restarted rank can read the previous
    attempt's keys — gloo's peer addresses — and connect to a dead rank ("Connection refused"; the
    race of pytorch issue 135712, fixed then by a new store per attempt, which 2.13's rendezvous no
    longer makes: it reuses the first). On one node every rank restarts together and
    ``TORCHELASTIC_RESTART_COUNT`` is the same on all of them, so it scopes the keys. Across nodes
    it is not (an agent that restarts for another node's failure does not count it), so there
    torch's ``env://`` is kept, and :func:`_require_restartable_launch` asks for a store of each
    attempt when the job may restart.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    agent_store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"nemo_wrap/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)


def _require_restartable_launch() -> None:
    """Refuse a several-node torchrun launch whose restarts would hang: with ``--max-restarts``,
    its agents sharing their store with the ranks (torchrun's default) and no attempt number the
    nodes agree on (see :func:`_attempt_store`), a restarted group reads the dead ranks' gloo
    addresses and waits on them until the timeout. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the
    launcher's environment gives each attempt a store of its own, hosted by its rank 0."""
    env = os.environ
    several_nodes = env.get("GROUP_WORLD_SIZE", "1") != "1"
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if several_nodes and restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        raise DistributedStateError(
            f"torchrun --max-restarts {restarts} across {env['GROUP_WORLD_SIZE']} nodes with the agents' shared store: "
            "a restarted group would meet the previous attempt's addresses in it and hang (pytorch issue 135712). "
            "Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment of every torchrun (each attempt then "
            "gets a store of its own), or restart the whole job instead (--max-restarts 0, --resume auto)"
        )


def destroy_distributed() -> None:
    """Tear down the default process group (no-op when there is none), so a kernel can start over."""
    global _single_process_store, _timeout_s, _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    _single_process_store = None
    _timeout_s = None
    _heartbeat = None


@contextmanager
def peers_must_answer(what: str) -> Iterator[None]:
    """Inside the block, a backend error raised after the block waited at least the collective
    timeout (another rank did not answer) becomes :class:`PeerTimeoutError` naming ``what`` (e.g.
    ``"training step 7"``), this rank and the timeout, the backend's message appended.

    Keep the block to one phase that normally takes far less than the timeout (a step, a save): an
    unrelated error of a block that ran longer would be reported as a timeout (its message kept).
    Without a timeout set by :func:`initialize_distributed` nothing is changed.
    """
    started = time.monotonic()
    try:
        yield
    except RuntimeError as error:  # gloo's class for a timeout (torch.distributed.DistBackendError derives from it)
        waited = time.monotonic() - started
        if _timeout_s is None or isinstance(error, NeMoWrapError):
            raise
        if waited >= _timeout_s:
            raise PeerTimeoutError(_peer_timeout_message(what, waited, error)) from error
        lost = _lost_peers()
        if lost:
            raise PeerLostError(f"{_this_rank()}: {what}: {lost}, and the job stops. {_first_line(error)}") from error
        raise


def _lost_peers() -> str | None:
    """Which other rank vanished, in words (``None``: every rank still beats, or no heartbeat)."""
    if _heartbeat is None:
        return None
    try:
        silent = _heartbeat.silent_ranks()
    except StoreGoneError as gone:
        return f"{gone}: the node hosting it is gone"
    if not silent:
        return None
    ranks = ", ".join(str(rank) for rank in silent)
    return f"rank {ranks} {'is' if len(silent) == 1 else 'are'} gone (killed, crashed or out of memory: see its log)"


def _this_rank() -> str:
    return f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "this process"


def _first_line(error: Exception) -> str:
    """The backend's error in one line (the command line prints the whole error on one line)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _peer_timeout_message(what: str, waited: float, error: Exception) -> str:
    return (
        f"{_this_rank()}: {what}: no answer from another rank within the timeout of {_timeout_s:g} s (--timeout; "
        f"waited {waited:.1f} s): that rank is hung, stopped or cut off, and the job stops. "
        f"{type(error).__name__}: {error}"
    )
