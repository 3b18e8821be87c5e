"""``python -m benchmarks``: run every benchmark, print its table, write ``benchmarks/RESULTS.md``.

Each benchmark's latest table is kept in ``benchmarks/results/NAME.md`` with the date and machine
it was measured on; ``RESULTS.md`` is all of them in suite order. ``--only load training_step ...``
re-runs some (names below) and keeps the others' latest tables. The documentation site's
benchmarks page includes ``RESULTS.md`` as it is.
Each benchmark runs its measurements in fresh processes; the whole suite takes about 35 minutes
on a 2-core machine (the three QLoRA tables about 14 of them), plus about 12 for ``peer``, 3 for
``verify``, 5 for ``default_precision``, 15 for ``published_layouts`` and hours for
``auto_at_scale``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import (
    bench_activation_checkpointing,
    bench_async_save,
    bench_auto_at_scale,
    bench_auto_layout,
    bench_checksums,
    bench_compile,
    bench_context_parallel,
    bench_default_precision,
    bench_expert_parallel,
    bench_from_config,
    bench_from_pretrained,
    bench_lora_step,
    bench_loss,
    bench_memory,
    bench_model_throughput,
    bench_peer,
    bench_pipeline,
    bench_precision,
    bench_preference_step,
    bench_published_layouts,
    bench_qlora,
    bench_training_step,
    bench_verify,
)
from benchmarks.common import Table

ROOT = Path(__file__).resolve().parent.parent
SUITE: dict[str, Callable[[], Table]] = {
    "load": bench_from_pretrained.table,
    "verify": bench_verify.table,
    "from_config": bench_from_config.table,
    "training_step": bench_training_step.table,
    "model_throughput": bench_model_throughput.table,
    "activation_checkpointing": bench_activation_checkpointing.table,
    "loss": bench_loss.table,
    "precision": bench_precision.table,
    "default_precision": bench_default_precision.table,
    "compile": bench_compile.table,
    "lora_step": bench_lora_step.table,
    "preference_step": bench_preference_step.table,
    "pipeline": bench_pipeline.table,
    "context_parallel": bench_context_parallel.table,
    "expert_parallel": bench_expert_parallel.table,
    "moe_save": bench_expert_parallel.save_table,
    "peer": bench_peer.table,
    "qlora_load": bench_qlora.table,
    "qlora_step": bench_qlora.step_table,
    "qlora_sft": bench_qlora.sft_table,
    "async_save": bench_async_save.table,
    "checksums": bench_checksums.table,
    "memory": bench_memory.table,
    "auto_layout": bench_auto_layout.table,
    "published_layouts": bench_published_layouts.table,
    "auto_at_scale": bench_auto_at_scale.table,
}


def machine() -> str:
    """The date and the machine, in one line (the numbers mean nothing without them)."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in lines if "model name" in line), platform.processor())
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores ({cpu}), {memory_gib:.0f} GiB RAM, "
        f"torch {torch.__version__}, Python {platform.python_version()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(SUITE), default=list(SUITE))
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    for name in args.only:
        text = SUITE[name]().markdown()
        print(f"\n{text}\n", flush=True)
        (results / f"{name}.md").write_text(f"{text}\n\nMeasured {machine()}.\n")
    kept = [results / f"{name}.md" for name in SUITE if (results / f"{name}.md").exists()]
    report = "\n".join(path.read_text() + "\n" for path in kept).rstrip() + "\n"
    (ROOT / "benchmarks" / "RESULTS.md").write_text(f"# Benchmark results\n\n{report}")


if __name__ == "__main__":
    main()
