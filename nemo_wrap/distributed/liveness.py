"""Which ranks are still alive, for naming the one that vanished when a collective fails.

A rank that dies (SIGKILL, the OOM killer, a crash) closes its connections, and gloo fails the
others' next collective at once with a plain ``RuntimeError`` ("Connection closed by peer"): the
class it raises for every failure, naming an address, not a rank. Messages are not matched, so
the failure itself cannot say which rank went. Each rank therefore beats in the job's store
(:class:`Heartbeat`: a counter per rank, incremented every :data:`BEAT_S` by a daemon thread on a
connection of its own); when a collective fails, the survivor reads the counters, waits
:data:`LISTEN_S`, and reads them again (:meth:`Heartbeat.silent_ranks`): a rank whose counter did
not move is gone (or stopped). The cost is one tiny store request per rank every
:data:`BEAT_S`, and :data:`LISTEN_S` added to a failure that is being reported anyway.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

BEAT_S = 0.5  # how often each rank beats
LISTEN_S = 2.0  # how long a survivor listens: four beats missed is not scheduling jitter
_STORE_TIMEOUT = timedelta(seconds=5)
_PREFIX = "nemo_wrap/heartbeat/"


class StoreGoneError(Exception):
    """The job's store no longer answers (the process hosting it is gone)."""


class Heartbeat:
    """This rank's beat in the store at ``host:port``, and a way to hear the others'."""

    def __init__(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="nemo_wrap-heartbeat", daemon=True)

    def _store(self) -> dist.Store:
        client = dist.TCPStore(self.host, self.port, is_master=False, timeout=_STORE_TIMEOUT)
        return dist.PrefixStore(_PREFIX, client)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2 * BEAT_S)

    def _beat(self) -> None:
        try:
            store = self._store()
            while not self._stopped.is_set():
                store.add(str(self.rank), 1)
                self._stopped.wait(BEAT_S)
        except Exception:  # the store went away: the job is ending, there is nobody to tell
            return

    def silent_ranks(self) -> list[int]:
        """The other ranks whose beat stopped: read, listen :data:`LISTEN_S`, read again. Raises
        :class:`StoreGoneError` when the store cannot be reached."""
        try:
            store = self._store()
            before = self._counts(store)
            time.sleep(LISTEN_S)
            after = self._counts(store)
        except Exception as error:  # its client raises several classes for a store that is gone
            raise StoreGoneError(f"the job's store at {self.host}:{self.port} does not answer") from error
        return [rank for rank in range(self.world_size) if rank != self.rank and after[rank] == before[rank]]

    def _counts(self, store: dist.Store) -> list[int]:
        return [store.add(str(rank), 0) for rank in range(self.world_size)]
