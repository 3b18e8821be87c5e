"""Process-group bootstrap that behaves the same under torchrun and in a notebook kernel.

Under torchrun the launcher exports ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` and we
join the default group through ``env://``. With no launcher (plain ``python``, a Jupyter kernel)
we make a world of one on a TCP store bound to port 0, so the OS picks a free port atomically and
two notebooks on one machine never collide. Re-running the cell that calls
:func:`initialize_distributed` must be harmless, so an initialized group is never re-initialized:
the existing one is described and returned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_wrap.errors import DistributedStateError

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SUPPORTED_BACKENDS = ("gloo", "nccl")

# The store of a single-process world must outlive the call that created it.
_single_process_store: dist.TCPStore | None = None


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
    if _launched_by_torchrun():
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        global _single_process_store
        _single_process_store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
        dist.init_process_group(backend, store=_single_process_store, rank=0, world_size=1, timeout=timeout)
    env = _describe_current_group()
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    return env


def destroy_distributed() -> None:
    """Tear down the default process group (no-op when there is none), so a kernel can start over."""
    global _single_process_store
    if dist.is_initialized():
        dist.destroy_process_group()
    _single_process_store = None
