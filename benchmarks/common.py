"""What every benchmark shares: fresh-process measurements, memory readings and the result table.

A measurement runs in a fresh process (or a fresh torchrun job), so its peak RSS and its imports
are its own: the parent runs ``python -m benchmarks.<module> --measure KIND --output DIR``, the
child calls its module's ``measure(kind)`` and writes the returned dict as ``DIR/KIND-RANK.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Table:
    """One benchmark's result: a markdown table and a sentence on how it was measured."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def markdown(self) -> str:
        lines = [f"| {self.title} | " + " | ".join(self.columns) + " |", "|---" * (len(self.columns) + 1) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines) + (f"\n\n{self.note}" if self.note else "")


def status_mib(field_name: str) -> float:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM, RssFile, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field_name} in /proc/self/status")


def reset_peak_rss() -> None:
    """Start the VmHWM mark again from the current RSS (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def touch(tensors, write: bool = False) -> int:
    """Read (``write``: rewrite) one byte of every 4 KiB page of every tensor, so lazily mapped
    pages are paid for (a write also pays a copy-on-write mapping's private copy)."""
    import torch

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel():
            pages = local.detach().reshape(-1).view(torch.uint8)[::4096]
            total += int(pages.sum())
            if write:
                with torch.no_grad():
                    pages.add_(0)
    return total


def run_measure(
    module: str, kind: str, nproc: int = 1, env: dict[str, str] | None = None, check: bool = True
) -> list[dict[str, Any]]:
    """Run ``module``'s ``measure(kind)`` in a fresh process (``nproc > 1``: a torchrun job); the
    dicts it returned, one per rank, in rank order. ``check=False``: a failed job gives one row
    ``{"error": its first exception line, "rank": 0}`` instead of raising (its stderr is captured)."""
    with tempfile.TemporaryDirectory() as output:
        child = ["-m", module, "--measure", kind, "--output", output]
        if nproc > 1:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            command = [*torchrun, *child]
        else:
            command = [sys.executable, *child]
        stderr = None if check else subprocess.PIPE
        done = subprocess.run(
            command, check=check, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=stderr, text=True
        )
        if done.returncode:
            return [{"error": first_error_line(done.stderr, done.returncode), "rank": 0}]
        rows = [json.loads(path.read_text()) for path in Path(output).glob("*.json")]
    return sorted(rows, key=lambda row: row["rank"])


def first_error_line(stderr: str, returncode: int) -> str:
    """The first ``SomeError: message`` line of a failed job's stderr (the root cause comes first;
    the other ranks' failures follow it), without torchrun's ``[rankN]:`` prefix."""
    for line in stderr.splitlines():
        match = re.search(r"\b(\w+(?:Error|Exception)): (.+)", line)
        if match:
            return f"{match.group(1)}: {match.group(2)}"[:160]
    return f"exit code {returncode}"


def best_of(repeats: int, module: str, kinds: list[str], nproc: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Each kind ``repeats`` times, alternating kinds so background load hits them alike (:func:`all_runs`);
    per kind, the run whose slowest rank was fastest."""
    runs = all_runs(repeats, module, kinds, nproc)
    return {kind: min(rows, key=lambda run: max(r["seconds"] for r in run)) for kind, rows in runs.items()}


def all_runs(
    repeats: int, module: str, kinds: list[str], nproc: dict[str, int] | None = None, check: bool = True
) -> dict[str, list[list[dict]]]:
    """Each kind ``repeats`` times, alternating kinds as :func:`best_of` does; per kind every run's
    rows, in run order (for a spread, not only the best). With ``check=False`` a kind whose run
    failed keeps that one error run and is not run again."""
    runs: dict[str, list[list[dict]]] = {kind: [] for kind in kinds}
    for _ in range(repeats):
        for kind in kinds:
            if not any("error" in rows[0] for rows in runs[kind]):
                runs[kind].append(run_measure(module, kind, (nproc or {}).get(kind, 1), check=check))
    return runs


MATMUL_SIZE = 2048


def matmul_rate(dtype: Any = None) -> float:
    """This rank's matmul FLOP/s in ``dtype`` (default fp32) while every rank runs the same products:
    the best of 3 rounds of two ``MATMUL_SIZE``² products, each timed from a barrier to the barrier
    after the slowest rank, so the ranks' rates add up to what the machine delivers to this many
    ranks. Achieved FLOP/s ÷ this is how far a step is from the hardware's limit, on any machine."""
    import torch
    import torch.distributed as dist

    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype or torch.float32)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype or torch.float32)
    torch.mm(a, b)
    best = 0.0
    for _ in range(3):
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        for _ in range(2):
            torch.mm(a, b)
        if dist.is_initialized():
            dist.barrier()
        best = max(best, 2 * 2 * MATMUL_SIZE**3 / (time.perf_counter() - started))
    return best


def memory_floor_mib(
    params: float, shards: int, gathered_params: float, activation_bytes: float, baseline_mib: float
) -> float:
    """An analytic lower bound on a training rank's RSS (fp32, AdamW), in MiB: parameters, gradients
    and AdamW's two states over their shard degree (16 bytes a parameter), the largest layer held
    unsharded at once (an FSDP all-gather), the step's activations, and the process's baseline RSS
    (after imports, before loading). The gathered layer's gradient is left out: it lives while
    that layer's activations are being freed, so counting both would overstate the bound."""
    state = 4 * 4 * params / shards
    gathered = 4 * gathered_params
    return baseline_mib + (state + gathered + activation_bytes) / 2**20


def measure_main(measure: Callable[[str], dict[str, Any]], table: Callable[[], Table]) -> None:
    """A benchmark module's ``__main__``: measure one kind in this process, or print the table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.measure is None:
        print(table().markdown())
        return
    row = measure(args.measure)
    rank = int(os.environ.get("RANK", 0))
    if row:
        (args.output / f"{args.measure}-{rank}.json").write_text(json.dumps({**row, "rank": rank}))


def per_rank_memory_cells(rows: list[dict[str, Any]], reference_peak_mib: float) -> tuple[list[str], float]:
    """A multi-rank case's cells — peak RSS once loaded and after training, per rank; the worst
    rank's peak against ``reference_peak_mib``; the slowest rank's step — and that step's seconds."""
    peak, seconds = max(row["peak_mib"] for row in rows), max(row["seconds"] for row in rows)
    loaded = " / ".join(f"{row['loaded_mib']:.0f}" for row in rows)
    trained = " / ".join(f"{row['peak_mib']:.0f}" for row in rows)
    return [f"{loaded} MiB", f"{trained} MiB", f"{peak / reference_peak_mib:.2f}", f"{seconds:.2f} s"], seconds
