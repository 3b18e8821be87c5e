"""Which ranks are still alive, for naming the one that vanished when a collective fails.

A rank that dies (SIGKILL, the OOM killer, a crash) closes its connections, and gloo fails the
others' next collective at once with a plain ``RuntimeError`` ("Connection closed by peer"): the
class it raises for every failure, naming an address, not a rank. Messages are not matched, so
the failure itself cannot say which rank went. Each rank therefore beats in the job's store
(:class:`Heartbeat`: a counter per rank, incremented every :data:`BEAT_S` by a daemon thread on a
connection of its own); when a collective fails, the survivor reads the counters, waits
:data:`LISTEN_S`, and reads them again (:meth:`Heartbeat.silent_ranks`): a rank whose counter did
not move is gone, unless it marked itself stopped: a rank that ends on purpose (its own error
reported, or done) writes that mark as its beat's last act, so with three ranks or more a survivor
that listens after a neighbour already exited blames only the rank that vanished. The cost is one
tiny store request per rank every :data:`BEAT_S`, and :data:`LISTEN_S` added to a failure that is
being reported anyway.

The beat is stopped at interpreter exit (``atexit``), before Python finalizes: a daemon thread
that comes back from the store's C++ client while the interpreter finalizes is ended by
``pthread_exit`` inside a C++ destructor, which aborts the process (SIGABRT) — seen when a job's
last rank outlived the agent hosting the store.
"""

from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta

import torch.distributed as dist

BEAT_S = 0.5  # how often each rank beats
LISTEN_S = 2.0  # how long a survivor listens: four beats missed is not scheduling jitter
_STORE_TIMEOUT = timedelta(seconds=5)
_PREFIX = "nemo_wrap/heartbeat/"
_STOPPED = "stopped/"  # + rank: the rank ended on purpose


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
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """End the beat, marking this rank stopped; waits for a store request in flight to end."""
        self._stopped.set()
        self._thread.join(timeout=_STORE_TIMEOUT.total_seconds() + BEAT_S)
        atexit.unregister(self.stop)

    def _beat(self) -> None:
        """Beat until stopped. A failed request (a store slow under load, a connection lost) is
        retried at the next beat on a new connection: one failure must not silence a live rank."""
        store: dist.Store | None = None
        while not self._stopped.is_set():
            try:
                if store is None:
                    store = self._store()
                    store.delete_key(f"{_STOPPED}{self.rank}")  # the mark of an earlier attempt (restart)
                store.add(str(self.rank), 1)
            except Exception:  # its client raises several classes; the next beat tries again
                store = None
            self._stopped.wait(BEAT_S)
        try:
            (store or self._store()).set(f"{_STOPPED}{self.rank}", "1")
        except Exception:  # the store is gone with the job: nobody is left to mislead
            return

    def silent_ranks(self) -> list[int]:
        """The other ranks whose beat stopped without their stop mark: read, listen
        :data:`LISTEN_S`, read again. Raises :class:`StoreGoneError` when the store cannot be
        reached."""
        try:
            store = self._store()
            before = self._counts(store)
            time.sleep(LISTEN_S)
            after = self._counts(store)
            others = [rank for rank in range(self.world_size) if rank != self.rank]
            silent = [rank for rank in others if after[rank] == before[rank]]
            return [rank for rank in silent if not store.check([f"{_STOPPED}{rank}"])]
        except Exception as error:  # its client raises several classes for a store that is gone
            raise StoreGoneError(f"the job's store at {self.host}:{self.port} does not answer") from error

    def _counts(self, store: dist.Store) -> list[int]:
        return [store.add(str(rank), 0) for rank in range(self.world_size)]
