"""What resume tests compare and how they kill a save half-way: shared by the checkpoint test files."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch


def local_copy(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard), detached and copied."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def local_state(model, optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and of AdamW's moments and step counts."""
    state = {f"model.{k}": local_copy(v) for k, v in model.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        state.update({f"optimizer.{index}.{k}": local_copy(v) for k, v in moments.items()})
    return state


def kill_at_markers(children: list[tuple[subprocess.Popen, Path]]) -> None:
    """SIGKILL each saving child once it has touched its marker file (it then stalls mid-write);
    every child is gone when this returns, whatever happened."""
    try:
        for child, marker in children:
            deadline = time.monotonic() + 90
            while not marker.exists():
                assert child.poll() is None, f"the saving child exited early with {child.returncode}"
                assert time.monotonic() < deadline, "the saving child never reached the write"
                time.sleep(0.1)
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        for child, _ in children:
            if child.poll() is None:
                child.kill()
                child.wait()
