"""Where training metrics go: a JSONL file (one object per logged step) and the trackers asked for.

``metrics.jsonl`` is always written, because it needs no package and is what tests and scripts read;
TensorBoard, Weights & Biases and MLflow are added with transformers' ``report_to`` names (see
:mod:`nemo_wrap.recipes.trackers`). Only the writer rank writes; every rank keeps ``records``, so
the loop calls ``log`` on every rank and each returns the same history.

A tracker that fails once it is open (a full disk under its directory, a lost MLflow server, a
crashed ``wandb-core``) is dropped: closed as well as it can be, with one warning naming it and the
error, and the run goes on. Raising would stop the writer rank alone, and the other ranks would
wait for it at their next collective until the timeout; the metrics are not lost either, since
``metrics.jsonl`` keeps every step. The same holds for ``metrics.jsonl`` itself: a write that fails
(a full disk) ends the file with one warning naming it and the step, and the run goes on (every
rank's ``records`` and the trackers still hold the steps; a full disk fails the next checkpoint
save on every rank anyway). Failing to *open* a tracker stays fatal, on every rank together
(the caller opens the log through :meth:`RankGroup.on_every_rank`): that is a setup error to fix
before training, not a fault of a running job.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from nemo_wrap.recipes.trackers import REPORT_TO_NAMES, Tracker, open_tracker, parse_report_to, require_packages

__all__ = ["REPORT_TO_NAMES", "MetricsLog", "parse_report_to"]

logger = logging.getLogger("nemo_wrap")


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
        self._trackers: dict[str, Tracker] = {}
        self.enabled = directory is not None and is_writer
        if directory is not None:
            require_packages(names)
        if not self.enabled:
            return
        self.directory = Path(str(directory))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._jsonl: TextIO | None = open(self.directory / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        config = _plain(run_config or {})
        try:
            for name in names:
                self._trackers[name] = open_tracker(name, self.directory, config, mlflow_tracking_uri, run_name)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, **values: float) -> None:
        record = {"step": step, **values}
        self.records.append(record)
        if not self.enabled:
            return
        self._append(record)
        if values:
            for name, tracker in list(self._trackers.items()):
                try:
                    tracker.log(step, values)
                except Exception as error:  # a tracker's fault must not stop the writer rank alone
                    del self._trackers[name]
                    _close_quietly(name, tracker, f"failed at step {step} ({type(error).__name__}: {error})")

    def _append(self, record: dict[str, Any]) -> None:
        """One line of ``metrics.jsonl``; a failed write ends the file with a warning (see the module)."""
        if self._jsonl is None:
            return
        try:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        except OSError as error:
            jsonl, self._jsonl = self._jsonl, None
            what_follows = "the file ends before it; training goes on, the trackers still get the metrics"
            logger.warning("%s: writing step %d failed (%s): %s", jsonl.name, record["step"], error, what_follows)
            _close_file_quietly(jsonl)

    def close(self) -> None:
        """Close the file and end every tracker's run; a tracker that fails to close is reported
        with a warning, not raised (the other ranks would wait for this one). Safe to call twice."""
        if not self.enabled:
            return
        self.enabled = False
        trackers, self._trackers = self._trackers, {}
        for name, tracker in trackers.items():
            try:
                tracker.close()
            except Exception as error:
                logger.warning("tracker %s: failed to close (%s: %s)", name, type(error).__name__, error)
        if self._jsonl is not None:
            _close_file_quietly(self._jsonl)

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers still receiving the metrics (one that failed is dropped)."""
        return tuple(self._trackers)


def _close_quietly(name: str, tracker: Tracker, what: str) -> None:
    """Close a tracker that failed, saying once what happened; an error closing it is only added."""
    try:
        tracker.close()
        closed = "closed"
    except Exception as error:
        closed = f"closing it failed too ({type(error).__name__}: {error})"
    logger.warning("tracker %s %s: %s; the run goes on, metrics.jsonl keeps every step", name, what, closed)


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as JSON types only (paths and other objects as strings, tuples as lists), so every
    tracker records the same values and none chokes on a type it cannot serialize."""
    return dict(json.loads(json.dumps(config, default=str)))


def _close_file_quietly(file: TextIO) -> None:
    """Close ``file``. Each line is flushed as it is logged, so only a line whose write already
    failed (and was warned about) can be left to fail again here."""
    with contextlib.suppress(OSError):
        file.close()
