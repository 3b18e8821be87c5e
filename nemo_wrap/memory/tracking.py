"""What "a step's peak" means here, in one place: torch's ``MemTracker`` over the second of two
steps (the first makes the optimizer's state). The dry run measures its fake step with it, and the
tests and ``benchmarks/bench_memory.py`` the real step they compare the prediction with."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed._tools.mem_tracker import MemTracker


def second_step_peak(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], object]
) -> dict[str, int]:
    """Bytes at the peak of the second of two calls of ``step``, on the device that peaks highest:
    ``"Total"`` and each of torch's categories by its name (``"Parameter"``, ``"Optstate"``, ...)."""
    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    snapshot = max(tracker.get_tracker_snapshot("peak").values(), key=lambda device: device["Total"])
    return {getattr(key, "value", key): int(value) for key, value in snapshot.items()}
