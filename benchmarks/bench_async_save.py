"""How long a checkpoint save stalls training, written synchronously against in the background.

The 100M Llama (fp32) of the step benchmarks with its AdamW state, batch 2 × 256 tokens, saved by
``CheckpointRotation`` (``keep_last=1``) after a step. The stall is what the save adds to training,
(step + save) − step. Synchronously that is the whole save: DCP's shards, fsync, the atomic move.
In the background (``asynchronous=True``) it is the copy of the state to memory at the call, plus
what the writing thread takes from the steps that run meanwhile (their time over the median step),
plus any wait for the write at ``wait()``. Goal: async / sync < 0.2. One process (default threads)
and fsdp2 on 2 ranks × 1 thread, each in a fresh process. Run: ``python -m benchmarks.bench_async_save``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_lora_step import CHECKPOINT_100M, make_checkpoint_100m
from benchmarks.common import Table, measure_main, run_measure

BATCH, SEQUENCE, STEPS, OVERLAPPED = 2, 256, 3, 2
MODULE = "benchmarks.bench_async_save"
CASES = {"one": ("one process", 1), "fsdp2": ("fsdp2, 2 ranks × 1 thread", 2)}
COLUMNS = ["checkpoint", "step", "sync: stall", "async: at the call", f"async: {OVERLAPPED} steps slower by",
           "async: wait()", "async: total", "async / sync at the call", "async / sync total"]  # fmt: skip
DIRECTORY = "NEMO_WRAP_BENCH_SAVE_DIR"  # where the measuring processes write their checkpoints


def _model(kind: str) -> Any:
    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    if kind == "one":
        return NeMoAutoModelForCausalLM.from_pretrained(str(CHECKPOINT_100M))
    setup = DistributedSetup.build("fsdp2", initialize_distributed().world_size)
    return NeMoAutoModelForCausalLM.from_pretrained(str(CHECKPOINT_100M), distributed_setup=setup)


def _seconds(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(kind: str) -> dict[str, Any]:
    import torch

    from nemo_wrap.checkpoint import CheckpointRotation
    from nemo_wrap.training import train_step

    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32000, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        train_step(model, optimizer, [{"input_ids": tokens}])

    step()  # warm-up; AdamW's state exists from here on, so every save writes all of it
    baseline = statistics.median(_seconds(step) for _ in range(STEPS))
    directory = Path(os.environ[DIRECTORY])
    sync = CheckpointRotation(directory / "sync", keep_last=1)
    step()
    sync_stall = _seconds(lambda: sync.save(model, optimizer, 1))
    background = CheckpointRotation(directory / "async", keep_last=1, asynchronous=True)
    step()
    call = _seconds(lambda: background.save(model, optimizer, 1))
    overlapped = [_seconds(step) for _ in range(OVERLAPPED)]
    waited = _seconds(background.wait)
    background.close()
    slower = sum(seconds - baseline for seconds in overlapped)
    return {"seconds": baseline, "sync": sync_stall, "call": call, "slower": slower, "wait": waited}


def _row(label: str, rows: list[dict[str, Any]], gigabytes: float) -> list[str]:
    """The slowest rank's numbers (a step waits for the slowest rank)."""
    worst = {key: max(row[key] for row in rows) for key in ("seconds", "sync", "call", "slower", "wait")}
    total = worst["call"] + max(0.0, worst["slower"]) + worst["wait"]
    return [label, f"{gigabytes:.2f} GB", f"{worst['seconds']:.2f} s", f"{worst['sync']:.2f} s",
            f"{worst['call']:.2f} s", f"{worst['slower']:+.2f} s", f"{worst['wait']:.2f} s", f"{total:.2f} s",
            f"{worst['call'] / worst['sync']:.2f}", f"{total / worst['sync']:.2f}"]  # fmt: skip


def table() -> Table:
    make_checkpoint_100m()
    result = Table(
        f"save stall, 100M Llama fp32 + AdamW state, {BATCH} × {SEQUENCE} tokens",
        COLUMNS,
        note=f"Stall = (step + save) − step, slowest rank; the step is the median of {STEPS} without a save. "
        "Async total = the call + the overlapped steps' excess over that median + the wait for the write. "
        "One run per case, each in a fresh process; checkpoints written to the local disk (fsynced).",
    )
    for kind, (label, nproc) in CASES.items():
        with tempfile.TemporaryDirectory(prefix="bench_async_save_") as directory:
            rows = run_measure(MODULE, kind, nproc, env={DIRECTORY: directory})
            written = Path(directory) / "sync" / "checkpoint-1"
            gigabytes = sum(path.stat().st_size for path in written.iterdir()) / 1e9
        result.rows.append(_row(label, rows, gigabytes))
    return result


if __name__ == "__main__":
    measure_main(measure, table)
