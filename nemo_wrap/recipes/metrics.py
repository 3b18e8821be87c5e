"""Where training metrics go: a JSONL file (one object per logged step) and the trackers asked for.

``metrics.jsonl`` is always written, because it needs no package and is what tests and scripts read;
TensorBoard, Weights & Biases and MLflow are added with transformers' ``report_to`` names (see
:mod:`nemo_wrap.recipes.trackers`). Only the writer rank writes; every rank keeps ``records``, so
the loop calls ``log`` on every rank and each returns the same history.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_wrap.recipes.trackers import REPORT_TO_NAMES, Tracker, open_tracker, parse_report_to, require_packages

__all__ = ["REPORT_TO_NAMES", "MetricsLog", "parse_report_to"]


class MetricsLog:
    """``log(step, loss=..., lr=...)`` appends to ``metrics.jsonl`` under ``directory`` and to each tracker.

    ``directory=None`` or ``is_writer=False`` writes nothing (``records`` only). ``run_config`` is
    the job's settings, recorded once by each tracker (TensorBoard text, W&B config, MLflow params).
    A tracker whose package is missing raises :class:`nemo_wrap.errors.MissingExtraError` on every
    rank, before any file is opened.
    """

    def __init__(
        self,
        directory: str | Path | None,
        is_writer: bool,
        report_to: Sequence[str] = ("tensorboard",),
        run_config: Mapping[str, Any] | None = None,
        mlflow_tracking_uri: str | None = None,
        run_name: str | None = None,
    ) -> None:
        names = parse_report_to(report_to)
        self.records: list[dict[str, Any]] = []
        self._trackers: list[Tracker] = []
        self.enabled = directory is not None and is_writer
        if directory is not None:
            require_packages(names)
        if not self.enabled:
            return
        self.directory = Path(str(directory))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.directory / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        config = _plain(run_config or {})
        try:
            for name in names:
                self._trackers.append(open_tracker(name, self.directory, config, mlflow_tracking_uri, run_name))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, **values: float) -> None:
        record = {"step": step, **values}
        self.records.append(record)
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if values:
            for tracker in self._trackers:
                tracker.log(step, values)

    def close(self) -> None:
        """Close the file and end every tracker's run (each even if another fails); safe to call twice."""
        if not self.enabled:
            return
        self.enabled = False
        trackers, self._trackers = self._trackers, []
        errors: list[Exception] = []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as error:  # the other runs still end, then the first failure is raised
                errors.append(error)
        self._jsonl.close()
        if errors:
            raise errors[0]


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as JSON types only (paths and other objects as strings, tuples as lists), so every
    tracker records the same values and none chokes on a type it cannot serialize."""
    return dict(json.loads(json.dumps(config, default=str)))
