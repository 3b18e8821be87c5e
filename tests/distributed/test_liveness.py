"""The heartbeat names the rank that vanished, and only that rank.

Three ranks beat in one store: rank 2 is a real process SIGKILLed mid-beat, rank 1 ends on
purpose (its stop mark written). Rank 0, listening after both went quiet, must blame rank 2 alone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import torch.distributed as dist

from nemo_wrap.distributed.liveness import BEAT_S, Heartbeat

_BEATING_RANK = """
import sys, time
from nemo_wrap.distributed.liveness import Heartbeat
Heartbeat("127.0.0.1", int(sys.argv[1]), 2, 3).start()
print("beating", flush=True)
time.sleep(60)
"""


def test_a_killed_rank_is_named_and_a_rank_that_stopped_on_purpose_is_not():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    killed = subprocess.Popen([sys.executable, "-c", _BEATING_RANK, str(store.port)], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout is not None and killed.stdout.readline().strip() == "beating"
        listener = Heartbeat("127.0.0.1", store.port, 0, 3).start()
        stopping = Heartbeat("127.0.0.1", store.port, 1, 3).start()
        time.sleep(3 * BEAT_S)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        stopping.stop()
        assert listener.silent_ranks() == [2]
        listener.stop()
    finally:
        killed.kill()
        killed.wait(timeout=10)

