"""What content digests cost a checkpoint's save and its resume.

The 100M Llama (fp32) with its AdamW state after one step, one process, written to the local disk.
Save: DCP's save through :class:`DigestingWriter` (every byte hashed with XXH3 as it is written)
against DCP's own ``FileSystemWriter`` (no digest), alternated, each the median of :data:`REPEATS`;
their difference is within the disk's noise, so the digest's cost is also measured directly — XXH3
over the written bytes in memory, the work the writing thread adds — and given as a share of the
whole ``save_checkpoint`` (staging, DCP, manifest, fsync, atomic move). Resume: the whole
``load_checkpoint`` (which checks the digests first) against the check alone (``verify_contents``:
every file mapped and hashed, from the page cache here, as on a resume soon after the save).
Goals: ≤ 5% of the save, ≤ 10% of the resume. Run: ``python -m benchmarks.bench_checksums``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.bench_lora_step import CHECKPOINT_100M, make_checkpoint_100m
from benchmarks.common import Table, measure_main, run_measure

REPEATS = 5
MODULE = "benchmarks.bench_checksums"
DIRECTORY = "NEMO_WRAP_BENCH_CHECKSUM_DIR"
COLUMNS = ["checkpoint", "DCP write, no digest", "DCP write with digests", "difference", "hashing the bytes",
           "whole save", "hashing / whole save", "whole resume", "digest check", "check / whole resume"]  # fmt: skip


def _seconds(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(kind: str) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    import xxhash
    from torch.distributed.checkpoint import FileSystemWriter

    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.checkpoint import load_checkpoint, save_checkpoint
    from nemo_wrap.checkpoint.digest import DigestingWriter
    from nemo_wrap.checkpoint.manifest import verify_contents
    from nemo_wrap.checkpoint.resume import _training_state
    from nemo_wrap.distributed.collectives import RankGroup
    from nemo_wrap.training import train_step

    model = NeMoAutoModelForCausalLM.from_pretrained(str(CHECKPOINT_100M))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, optimizer, [{"input_ids": torch.randint(0, 32000, (2, 64))}])
    root = Path(os.environ[DIRECTORY])
    state = _training_state(model, optimizer, 1, None)
    writers = {"plain": FileSystemWriter, "digest": DigestingWriter}
    times: dict[str, list[float]] = {name: [] for name in writers}
    for repeat in range(REPEATS):
        for name, writer in writers.items():
            target = root / f"{name}-{repeat}"
            times[name].append(_seconds(partial(dcp.save, state, storage_writer=writer(target))))
            shutil.rmtree(target)
    whole = statistics.median(
        _seconds(lambda: save_checkpoint(root / "ckpt", model, optimizer, 1)) for _ in range(REPEATS)
    )
    loads = [_seconds(lambda: load_checkpoint(root / "ckpt", model, optimizer)) for _ in range(REPEATS)]
    checks = [_seconds(lambda: verify_contents(root / "ckpt", RankGroup.job())) for _ in range(REPEATS)]
    files = [path.read_bytes() for path in sorted((root / "ckpt").iterdir())]
    hashing = statistics.median(_seconds(lambda: [xxhash.xxh3_64(data) for data in files]) for _ in range(REPEATS))
    return {
        "plain": statistics.median(times["plain"]),
        "digest": statistics.median(times["digest"]),
        "whole": whole,
        "load": statistics.median(loads),
        "check": statistics.median(checks),
        "hashing": hashing,
        "gigabytes": sum(path.stat().st_size for path in (root / "ckpt").iterdir()) / 1e9,
    }


def table() -> Table:
    make_checkpoint_100m()
    result = Table(
        "content digests (XXH3, taken while writing), 100M Llama fp32 + AdamW state, one process",
        COLUMNS,
        note=f"Medians of {REPEATS}, the two writers alternated; files fsynced to the local disk; the resume reads "
        "from the page cache. The writers' difference is mostly the disk's variance (it changes sign between runs); "
        "the digest's own cost is the hashing of the written bytes, in memory, as the writing thread does it.",
    )
    with tempfile.TemporaryDirectory(prefix="bench_checksums_") as directory:
        (row,) = run_measure(MODULE, "one", 1, env={DIRECTORY: directory})
    result.rows.append([
        f"{row['gigabytes']:.2f} GB", f"{row['plain']:.2f} s", f"{row['digest']:.2f} s",
        f"{row['digest'] - row['plain']:+.2f} s", f"{row['hashing']:.2f} s", f"{row['whole']:.2f} s",
        f"{row['hashing'] / row['whole']:.1%}", f"{row['load']:.2f} s", f"{row['check']:.2f} s",
        f"{row['check'] / row['load']:.1%}",
    ])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
