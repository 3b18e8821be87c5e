"""Metrics reach every tracker asked for, and read back, with each library's own reader, as logged.

Real TensorBoard, W&B (offline) and MLflow (file store) runs in a temporary directory; nothing is
mocked but a missing package. W&B 0.31 ships no Python reader of its ``.wandb`` run file (the old
``wandb.sdk.internal.datastore`` went with the Go core), so the test unframes its LevelDB-style log
(32 KiB blocks of CRC-checked chunks) and decodes each record with wandb's own protobuf ``Record``.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nemo_wrap.errors import InvalidSetupError, MissingExtraError
from nemo_wrap.recipes.metrics import REPORT_TO_NAMES, MetricsLog, parse_report_to
from nemo_wrap.recipes.trackers import MLFLOW_MAX_PARAM_KEY, MLFLOW_MAX_PARAM_VALUE, mlflow_params, open_tracker

RUN_CONFIG = {"model": "tiny", "optimizer": {"lr": 1e-3, "betas": (0.9, 0.95)}, "seed": 7, "resume": None}


@pytest.fixture
def tracker_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No user settings leak in; whatever the trackers set in ``os.environ`` is undone afterwards."""
    names = ("WANDB_PROJECT", "WANDB_DIR", "WANDB_NAME", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")
    for name in (*names, "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # recorded, so monkeypatch restores the original state...
        monkeypatch.delenv(name)  # ...even of a variable the code under test adds
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path_factory.mktemp("wandb_cache")))  # its service's logs


def _train(log: MetricsLog) -> None:
    for step in range(1, 6):
        log.log(step, loss=2.0 / step + 0.01 * step, lr=1e-3 * step / 5, grad_norm=1.5 - 0.1 * step)
    log.log(5, eval_loss=0.875)


def _jsonl(directory: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for line in (directory / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        for name, value in record.items():
            series.setdefault(name, {})[step] = value
    return series


@pytest.mark.usefixtures("tracker_env")
def test_every_tracker_reads_back_what_metrics_jsonl_holds(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, is_writer=True, report_to=REPORT_TO_NAMES, run_config=RUN_CONFIG, run_name="roundtrip")
    _train(log)
    log.close()
    expected = _jsonl(tmp_path)
    assert sorted(expected) == ["eval_loss", "grad_norm", "loss", "lr"] and len(expected["loss"]) == 5
    assert log.records[-1] == {"step": 5, "eval_loss": 0.875}

    tensorboard = _tensorboard_series(tmp_path, with_config=True)
    for name, series in expected.items():  # TensorBoard keeps scalars as float32
        assert tensorboard[name] == {step: struct.unpack("f", struct.pack("f", v))[0] for step, v in series.items()}

    history, config, run = _wandb_run(tmp_path)
    assert run.display_name == "roundtrip" and run.project == "nemo_wrap"
    for name, series in expected.items():
        assert {step: row[name] for step, row in history.items() if name in row} == series
    assert config["optimizer"] == {"lr": 1e-3, "betas": [0.9, 0.95]} and config["seed"] == 7

    metrics, params = _mlflow_run(tmp_path / "mlruns")
    for name, series in expected.items():
        assert metrics[name] == series
    flat = {"model": "tiny", "optimizer.lr": "0.001", "optimizer.betas": "[0.9, 0.95]", "seed": "7", "resume": "null"}
    assert params == flat
    assert not _wandb_core_children(), "wandb-core still runs after close"


def _tensorboard_series(directory: Path, with_config: bool = False) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    assert ("config/text_summary" in events.Tags()["tensors"]) == with_config
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _mlflow_run(store: Path, name: str = "roundtrip") -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store.as_uri())
    experiment = client.get_experiment_by_name("nemo_wrap")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == name
    metrics = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)} for name in run.data.metrics
    }
    return metrics, run.data.params


def _wandb_run(directory: Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any], Any]:
    """History rows by step, the config, and the run record of the one offline run under ``directory``."""
    (run_file,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    run = None
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(row)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({_key(item): json.loads(item.value_json) for item in updates})
            run = record.run if kind == "run" else run
    return history, config, run


def _key(item: Any) -> str:
    """A history or config item's name: wandb-core writes it as ``key`` or as ``nested_key`` parts."""
    return str(item.key) or ".".join(item.nested_key)


def _wandb_records(path: Path) -> Iterator[Any]:
    """wandb's ``Record`` protobufs from a ``.wandb`` file: a 7-byte header, then 32 KiB blocks of
    chunks (crc32 of type and data, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4, data)."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:header] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
    offset, pending = header, b""
    while offset + header <= len(data):
        if block - offset % block < header:  # too little room left for a chunk: zero padding
            offset += block - offset % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[offset : offset + header])
        chunk = data[offset + header : offset + header + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"corrupt chunk at {offset}"
        offset, pending = offset + header + length, pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # star-imported per protobuf major
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_core_children() -> list[str]:
    """Command lines of this process's live children that are wandb's service."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            command = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # the process ended while being read
            continue
        if int(fields.get("PPid", "0")) == os.getpid() and "wandb-core" in command:
            found.append(command)
    return found


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("none", ()),
        (["none"], ()),
        ([], ()),
        ("tensorboard", ("tensorboard",)),
        ("wandb, tensorboard,wandb", ("wandb", "tensorboard")),
        (["mlflow", "tensorboard,mlflow"], ("mlflow", "tensorboard")),
    ],
)
def test_parse_report_to(value: Any, names: tuple[str, ...]) -> None:
    assert parse_report_to(value) == names


@pytest.mark.parametrize("value", ["tensorbord", "wandb,comet_ml", ["none", "wandb"]])
def test_parse_report_to_names_the_unknown_tracker_and_the_valid_ones(value: Any) -> None:
    with pytest.raises(InvalidSetupError) as error:
        parse_report_to(value)
    bad = next(name for name in ("tensorbord", "comet_ml", "none") if name in str(value))
    assert repr(bad) in str(error.value) and "tensorboard, wandb, mlflow" in str(error.value)


@pytest.mark.usefixtures("tracker_env")
@pytest.mark.parametrize(("directory", "is_writer"), [(True, False), (None, True)])
def test_only_the_writer_with_a_directory_writes(tmp_path: Path, directory: Any, is_writer: bool) -> None:
    log = MetricsLog(tmp_path if directory else None, is_writer, report_to=REPORT_TO_NAMES, run_config=RUN_CONFIG)
    _train(log)
    log.close()
    assert len(log.records) == 6 and log.records[0]["step"] == 1
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_is_the_default_tracker(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, is_writer=True)
    _train(log)
    log.close()
    log.close()
    assert sorted(path.name.split(".")[0] for path in tmp_path.iterdir()) == ["events", "metrics"]
    assert _tensorboard_series(tmp_path)["eval_loss"] == {5: 0.875}


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
@pytest.mark.parametrize("is_writer", [True, False])
def test_a_missing_package_names_its_extra_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracker: str, is_writer: bool
) -> None:
    for module in [name for name in sys.modules if name.split(".")[0] == tracker] or [tracker]:
        monkeypatch.setitem(sys.modules, module, None)  # what `import wandb` meets when it is not installed
    with pytest.raises(MissingExtraError, match=rf"pip install 'nemo_wrap\[{tracker}\]'"):
        MetricsLog(tmp_path, is_writer, report_to=["tensorboard", tracker])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(MissingExtraError, match=rf"report_to='{tracker}'"):
        open_tracker(tracker, tmp_path, {})


def test_mlflow_params_are_flat_strings_within_mlflow_limits() -> None:
    config = {"a": {"b": {"c": 1}, "empty": {}}, "flag": True, "text": "x" * (MLFLOW_MAX_PARAM_VALUE + 5)}
    config["k" * (MLFLOW_MAX_PARAM_KEY + 1)] = 1
    assert mlflow_params(config) == {
        "a.b.c": "1",
        "a.empty": "{}",
        "flag": "true",
        "text": "x" * MLFLOW_MAX_PARAM_VALUE,
    }


@pytest.mark.usefixtures("tracker_env")
def test_a_finetune_run_reports_every_step_to_every_tracker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI job end to end: each tracker holds the loss of every step, equal to ``metrics.jsonl``,
    and the resolved recipe as the run's config."""
    from nemo_wrap.cli import main

    monkeypatch.setenv("NEMO_WRAP_CACHE", str(tmp_path / "cache"))
    output = tmp_path / "job"
    assert main(["--steps", "3", "--output-dir", str(output), "--report-to", "tensorboard,wandb,mlflow"]) == 0
    logs = output / "logs"
    losses = _jsonl(logs)["loss"]
    assert sorted(losses) == [1, 2, 3]
    assert _tensorboard_series(logs, with_config=True)["loss"] == {
        step: struct.unpack("f", struct.pack("f", value))[0] for step, value in losses.items()
    }
    history, config, _ = _wandb_run(logs)
    assert {step: row["loss"] for step, row in history.items() if "loss" in row} == losses
    assert config["training"]["steps"] == 3 and config["logging"]["report_to"] == ["tensorboard", "wandb", "mlflow"]
    metrics, params = _mlflow_run(logs / "mlruns", name="job")
    assert metrics["loss"] == losses and params["training.steps"] == "3"
    assert {"lr", "tokens_per_s", "grad_norm", "peak_memory_mib"} <= set(metrics)


@pytest.mark.usefixtures("tracker_env")
def test_a_tracker_failing_mid_run_is_closed_with_one_warning_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's store vanishes after step 2 (as a lost server would): the run keeps logging to
    TensorBoard and metrics.jsonl, MLflow is dropped with one warning naming it and its error."""
    import shutil

    log = MetricsLog(tmp_path, is_writer=True, report_to=["tensorboard", "mlflow"], run_name="lost")
    log.log(1, loss=2.0)
    log.log(2, loss=1.5)
    shutil.rmtree(tmp_path / "mlruns")
    with caplog.at_level("WARNING", logger="nemo_wrap"):
        for step in range(3, 6):
            log.log(step, loss=1.0 / step)
        log.close()
    assert log.trackers == ()  # closed
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("tracker mlflow failed at step 3 (") and "metrics.jsonl keeps every step" in warning
    assert sorted(_jsonl(tmp_path)["loss"]) == [1, 2, 3, 4, 5]
    assert sorted(_tensorboard_series(tmp_path)["loss"]) == [1, 2, 3, 4, 5]


@pytest.mark.usefixtures("tracker_env")
def test_metrics_jsonl_on_a_full_disk_ends_with_one_warning_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``metrics.jsonl`` is /dev/full (every write fails with ENOSPC, as on a full disk): one
    warning naming the file and the first step, and TensorBoard still gets every step."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    with caplog.at_level("WARNING", logger="nemo_wrap"):
        log = MetricsLog(tmp_path, is_writer=True, report_to=["tensorboard"], run_name="full")
        for step in range(1, 6):
            log.log(step, loss=1.0 / step)
        log.close()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"{tmp_path / 'metrics.jsonl'}: writing step 1 failed (") and "No space" in warning
    assert [r["step"] for r in log.records] == [1, 2, 3, 4, 5]
    assert sorted(_tensorboard_series(tmp_path)["loss"]) == [1, 2, 3, 4, 5]


@pytest.mark.usefixtures("tracker_env")
def test_wandb_dir_is_honoured_when_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "wandb_home"
    elsewhere.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(elsewhere))
    log = MetricsLog(tmp_path / "logs", is_writer=True, report_to=["wandb"], run_name="elsewhere")
    _train(log)
    log.close()
    history, _, run = _wandb_run(elsewhere)
    assert run.display_name == "elsewhere" and sorted(history) == [1, 2, 3, 4, 5]
    assert not (tmp_path / "logs" / "wandb").exists()
