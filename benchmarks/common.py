"""What every benchmark shares: fresh-process measurements, memory readings and the result table.

A measurement runs in a fresh process (or a fresh torchrun job), so its peak RSS and its imports
are its own: the parent runs ``python -m benchmarks.<module> --measure KIND --output DIR``, the
child calls its module's ``measure(kind)`` and writes the returned dict as ``DIR/KIND-RANK.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def touch(tensors) -> int:
    """Read one byte of every 4 KiB page of every tensor, so lazily mapped pages are paid for."""
    import torch

    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel():
            total += int(local.detach().reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def run_measure(module: str, kind: str, nproc: int = 1, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``module``'s ``measure(kind)`` in a fresh process (``nproc > 1``: a torchrun job); the
    dicts it returned, one per rank, in rank order."""
    with tempfile.TemporaryDirectory() as output:
        child = ["-m", module, "--measure", kind, "--output", output]
        if nproc > 1:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            command = [*torchrun, *child]
        else:
            command = [sys.executable, *child]
        subprocess.run(command, check=True, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
        rows = [json.loads(path.read_text()) for path in Path(output).glob("*.json")]
    return sorted(rows, key=lambda row: row["rank"])


def best_of(repeats: int, module: str, kinds: list[str], nproc: dict[str, int] | None = None) -> dict[str, list[dict]]:
    """Each kind ``repeats`` times, alternating kinds so background load hits them alike; per kind,
    the run whose slowest rank was fastest."""
    best: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for kind in kinds:
            rows = run_measure(module, kind, (nproc or {}).get(kind, 1))
            if kind not in best or max(r["seconds"] for r in rows) < max(r["seconds"] for r in best[kind]):
                best[kind] = rows
    return best


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
