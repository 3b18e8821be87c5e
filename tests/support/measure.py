"""Time and peak RSS of one piece of work, in this process (Linux: the peak mark is reset first)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Measurement:
    seconds: float = 0.0
    peak_mb: float = 0.0  # peak RSS above the RSS at the start


def _status_mb(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(field + r":\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


@contextmanager
def measured() -> Iterator[Measurement]:
    """Fills the yielded :class:`Measurement` when the block ends (also when it raises)."""
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS mark starts again from here
    measurement = Measurement()
    start_mb, started = _status_mb("VmRSS"), time.monotonic()
    try:
        yield measurement
    finally:
        measurement.seconds = time.monotonic() - started
        measurement.peak_mb = _status_mb("VmHWM") - start_mb
