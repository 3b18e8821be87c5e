"""Where training metrics go: a JSONL file (one object per logged step) and TensorBoard events.

Only the writer rank writes; the others hold a no-op log, so the loop calls ``log`` on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """``log(step, loss=..., lr=...)`` appends to ``metrics.jsonl`` and to TensorBoard under ``directory``."""

    def __init__(self, directory: str | Path | None, is_writer: bool) -> None:
        self.enabled = directory is not None and is_writer
        self.records: list[dict[str, Any]] = []
        if not self.enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(str(directory))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.directory / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        self._tensorboard = SummaryWriter(str(self.directory))

    def log(self, step: int, **values: float) -> None:
        record = {"step": step, **values}
        self.records.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in values.items():
            self._tensorboard.add_scalar(name, value, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tensorboard.close()
