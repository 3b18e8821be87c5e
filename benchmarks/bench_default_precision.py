"""The default precision on a bf16 checkpoint: a LoRA chat job with default flags against ``--precision fp32``.

SmolLM2-135M-Instruct saved in bf16 (most downloaded checkpoints are), LoRA r=16 on all linear
layers, the bundled chat set packed into rows of 256 tokens, 4 rows a step, one process: the same
``nemo-wrap finetune`` command with no precision flag and with ``--precision fp32``, each in a fresh
process, alternating. Without a flag the checkpoint's bf16 is kept only where the CPU multiplies
bf16 natively (AVX512-BF16 / AMX); elsewhere the job trains in fp32 (a bf16 job there did not finish
4 steps in 15 minutes). Goal: the default job within 1.5× of the fp32 job's time. The table also
prints the precision line of the plan, so the choice and its reason are on record.
Run: ``python -m benchmarks.bench_default_precision``.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Table

STEPS, ROWS, LENGTH = 8, 4, 256
CASES = {"default": [], "fp32": ["--precision", "fp32"]}
LABELS = {"default": "default flags", "fp32": "`--precision fp32`"}


def _bf16_checkpoint(directory: Path) -> Path:
    """SmolLM2-135M-Instruct with its weights and config in bf16, and its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from nemo_wrap.default_model.smollm2 import smollm2_instruct_path

    source = smollm2_instruct_path()
    LlamaForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    return directory


def _run_job(checkpoint: Path, case: str, work: Path) -> dict[str, Any]:
    """One ``nemo-wrap finetune`` job in a fresh process: its wall time, plan line and step rates."""
    output = work / f"{case}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "nemo_wrap.cli", "finetune", str(checkpoint), "--data", "bundled:quack-chat-train",
               "--lora-r", "16", "--pack", "--max-length", str(LENGTH), "--batch-size", str(ROWS),
               "--steps", str(STEPS), "--report-to", "none", "--output-dir", str(output), *CASES[case]]  # fmt: skip
    started = time.perf_counter()
    finished = subprocess.run(command, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    plan_line = re.search(r"precision: (.*)", finished.stdout)
    records = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    rates = [record["tokens_per_s"] for record in records if "tokens_per_s" in record]
    losses = [record["loss"] for record in records if "loss" in record]
    return {"seconds": seconds, "plan": plan_line.group(1) if plan_line else "?", "tokens_per_s": rates[1:],
            "first_loss": losses[0], "last_loss": losses[-1]}  # fmt: skip


def table(repeats: int = 2) -> Table:
    from nemo_wrap.distributed.hardware import fast_matmul_dtypes

    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as work:
        checkpoint = _bf16_checkpoint(Path(work) / "smollm2-bf16")
        for _ in range(repeats):
            for case in CASES:
                runs[case].append(_run_job(checkpoint, case, Path(work)))
    best = {case: min(results, key=lambda r: r["seconds"]) for case, results in runs.items()}
    ratios = [d["seconds"] / f["seconds"] for d, f in zip(runs["default"], runs["fp32"], strict=True)]
    fast = sorted(str(dtype).removeprefix("torch.") for dtype in fast_matmul_dtypes("cpu")) or ["none"]
    result = Table(
        f"LoRA chat job, SmolLM2-135M-Instruct saved in bf16, {STEPS} steps of {ROWS} packed rows × {LENGTH} tokens",
        ["job", "vs fp32 job", "step (median tokens/s)", "loss first → last", "precision in the plan"],
        note=f"Best of {repeats} fresh `nemo-wrap finetune` processes per case, alternating; the job time includes "
        f"imports, loading and saving. Default / fp32 job time per repeat: {min(ratios):.2f}–{max(ratios):.2f} "
        f"(goal ≤ 1.5). This CPU's fast 16-bit matmul dtypes: {', '.join(fast)}.",
    )
    for case, run in best.items():
        result.rows.append([
            LABELS[case], f"{run['seconds']:.1f} s", f"{run['seconds'] / best['fp32']['seconds']:.2f}",
            f"{statistics.median(run['tokens_per_s']):.0f}", f"{run['first_loss']:.3f} → {run['last_loss']:.3f}",
            run["plan"],
        ])  # fmt: skip
    return result


if __name__ == "__main__":
    print(table().markdown())
