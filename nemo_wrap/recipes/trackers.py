"""Experiment trackers behind one tiny protocol, named with transformers' ``report_to`` vocabulary.

:class:`nemo_wrap.recipes.metrics.MetricsLog` fans each logged step out to the trackers opened
here. Each tracker's package is optional and imported only when that tracker is asked for, so
``import nemo_wrap`` never pays for wandb or MLflow, and a missing one fails with the extra that
brings it rather than a bare ``ModuleNotFoundError``.

Choices that are not the libraries' defaults, and why:

* W&B runs ``offline`` unless ``WANDB_MODE`` says otherwise: training nodes often have no network,
  and an online ``wandb.init`` without a login prompts or fails on the writer rank alone while the
  others wait in a collective. ``wandb sync DIR/wandb/offline-run-*`` uploads the run afterwards.
  The run is created with ``reinit="create_new"`` so a run the user opened is neither reused nor
  finished, and the ``wandb-core`` service is torn down on close unless such a run is still active.
* MLflow goes through :class:`mlflow.tracking.MlflowClient` (no global active run to leak) and,
  without a URI, stores the run in ``file:DIR/mlruns``. MLflow 3 refuses that file store unless
  ``MLFLOW_ALLOW_FILE_STORE`` is true; it is set (if unset) for local file stores only, because the
  SQLite store would need SQLAlchemy and Alembic, and SQLite locking is unreliable on the network
  file systems log directories often live on.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol
from urllib.parse import urlparse

from nemo_wrap.errors import InvalidSetupError, MissingExtraError

logger = logging.getLogger("nemo_wrap")

REPORT_TO_NAMES = ("tensorboard", "wandb", "mlflow")
DEFAULT_PROJECT = "nemo_wrap"
# MLflow's own limits (mlflow.utils.validation): longer keys are refused, longer values cut.
MLFLOW_MAX_PARAM_KEY = 250
MLFLOW_MAX_PARAM_VALUE = 6000
MLFLOW_MAX_PARAMS_PER_BATCH = 100


class Tracker(Protocol):
    """One experiment tracker's run: scalars per step, then closed once."""

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def parse_report_to(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` or ``["wandb"]`` as tracker names; ``"none"`` alone means none.

    Duplicates are dropped and the order kept; an unknown name raises :class:`InvalidSetupError`.
    """
    items: list[Any] = [value] if isinstance(value, str) or not isinstance(value, Sequence) else list(value)
    if not all(isinstance(item, str) for item in items):
        raise InvalidSetupError(f"report_to must be a string or a list of strings, got {value!r}")
    names = [piece.strip() for item in items for piece in item.split(",") if piece.strip()]
    if names == ["none"]:
        return ()
    valid = ", ".join(REPORT_TO_NAMES)
    for name in names:
        if name not in REPORT_TO_NAMES:
            hint = " ('none' only alone)" if name == "none" else ""
            raise InvalidSetupError(f"report_to: unknown tracker {name!r}{hint}; choose from {valid}, or none")
    return tuple(dict.fromkeys(names))


def require_packages(names: Sequence[str]) -> None:
    """Raise :class:`MissingExtraError` for the first tracker whose package is not installed.

    Cheap (nothing is imported), so every rank can run it and fail together, not the writer alone.
    """
    for name in names:  # each tracker's name is also its package's
        if importlib.util.find_spec(name) is None:
            raise _missing(name, f"no module named {name!r}")


def open_tracker(
    name: str,
    directory: Path,
    run_config: Mapping[str, Any],
    mlflow_tracking_uri: str | None = None,
    run_name: str | None = None,
) -> Tracker:
    """Start tracker ``name``'s run, writing under ``directory``."""
    if name == "tensorboard":
        return TensorBoardTracker(directory, run_config)
    if name == "wandb":
        return WandbTracker(directory, run_config, run_name)
    if name == "mlflow":
        return MlflowTracker(directory, run_config, mlflow_tracking_uri, run_name)
    raise InvalidSetupError(f"unknown tracker {name!r}; choose from {', '.join(REPORT_TO_NAMES)}")


class TensorBoardTracker:
    """Event files in ``directory`` itself (as before trackers existed); the config as a text summary."""

    def __init__(self, directory: Path, run_config: Mapping[str, Any]) -> None:
        tensorboard = _import("torch.utils.tensorboard", "tensorboard")
        self._writer = tensorboard.SummaryWriter(str(directory))
        if run_config:
            self._writer.add_text("config", f"```json\n{json.dumps(run_config, indent=2)}\n```")

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run under ``directory/wandb`` (or ``WANDB_DIR/wandb`` when set), offline unless
    ``WANDB_MODE`` is set; the config as its config."""

    def __init__(self, directory: Path, run_config: Mapping[str, Any], run_name: str | None) -> None:
        self._wandb = _import("wandb", "wandb")
        self._run = self._wandb.init(
            dir=None if os.environ.get("WANDB_DIR") else str(directory),  # W&B's own variable wins
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=run_name,
            config=dict(run_config),
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            reinit="create_new",
            settings=self._wandb.Settings(console="off"),  # no stdout/stderr capture of the training job
        )

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()
        if self._wandb.run is None:  # no run of the user's still needs the service
            self._wandb.teardown()


class MlflowTracker:
    """An MLflow run in experiment ``nemo_wrap`` (or ``MLFLOW_EXPERIMENT_NAME``), the config as params."""

    def __init__(
        self, directory: Path, run_config: Mapping[str, Any], tracking_uri: str | None, run_name: str | None
    ) -> None:
        tracking = _import("mlflow.tracking", "mlflow")
        self._entities = _import("mlflow.entities", "mlflow")
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (directory / "mlruns").resolve().as_uri()
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = tracking.MlflowClient(uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        experiment = self._client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(experiment_name)
        self.run_id: str = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [self._entities.Param(key, value) for key, value in mlflow_params(run_config).items()]
        for start in range(0, len(params), MLFLOW_MAX_PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[start : start + MLFLOW_MAX_PARAMS_PER_BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(name, float(value), now, step) for name, value in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def mlflow_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``config`` flattened to dotted keys with string values, within MLflow's length limits.

    Strings stay as they are, other values are JSON (``true``, ``null``, ``[1, 2]``); a value over
    the limit is cut, a key over it is left out with a warning (cutting could merge two keys).
    """
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(mlflow_params(value, f"{name}."))
        elif len(name) > MLFLOW_MAX_PARAM_KEY:
            logger.warning("mlflow: config key %.60s... is over %d characters, not logged", name, MLFLOW_MAX_PARAM_KEY)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            params[name] = text[:MLFLOW_MAX_PARAM_VALUE]
    return params


def _import(module: str, tracker: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise _missing(tracker, str(error)) from error


def _missing(tracker: str, reason: str) -> MissingExtraError:
    return MissingExtraError(
        f"report_to={tracker!r} needs a package that is not installed ({reason}): pip install 'nemo_wrap[{tracker}]'"
    )
