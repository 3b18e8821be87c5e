"""Activation checkpointing: a training step's peak memory and time with and without it.

One process, the 12-layer ~100M Llama of :mod:`benchmarks.bench_training_step`, fp32, one row of
1,024 tokens, AdamW, ``model.activation_checkpointing_enable()`` (transformers' switch, per decoder
layer). After a warm-up step (so the optimizer state exists), the step's peak is the peak RSS
above the RSS just before it: activations, gradients and the logits. Target: ≥ 40% lower with
checkpointing. Run: ``python -m benchmarks.bench_activation_checkpointing``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import Table, measure_main, reset_peak_rss, run_measure, status_mib

MODULE = "benchmarks.bench_activation_checkpointing"
TOKENS, STEPS = 1024, 3


def measure(kind: str) -> dict[str, Any]:
    import torch

    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    model = NeMoAutoModelForCausalLM.from_config(llama_100m_config(), seed=0).train()
    if kind == "checkpointed":
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    times, peaks = [], []
    for step in range(1 + STEPS):
        reset_peak_rss()
        before, started = status_mib("VmRSS"), time.perf_counter()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
            peaks.append(status_mib("VmHWM") - before)
    return {"seconds": statistics.median(times), "peak_mib": max(peaks)}


def table() -> Table:
    rows = {kind: run_measure(MODULE, kind)[0] for kind in ("plain", "checkpointed")}
    plain, checkpointed = rows["plain"], rows["checkpointed"]
    return Table(
        f"training step, 100M Llama (12 layers) fp32, one process, {TOKENS} tokens",
        ["step", "step peak RSS"],
        [
            ["without checkpointing", f"{plain['seconds']:.2f} s", f"{plain['peak_mib']:.0f} MiB"],
            [
                "`activation_checkpointing_enable()`",
                f"{checkpointed['seconds']:.2f} s",
                f"{checkpointed['peak_mib']:.0f} MiB",
            ],
            [
                "change",
                f"{checkpointed['seconds'] / plain['seconds'] - 1:+.0%}",
                f"{checkpointed['peak_mib'] / plain['peak_mib'] - 1:+.0%}",
            ],
        ],
        note=f"Median step time and largest step peak of {STEPS} steps after a warm-up step.",
    )


if __name__ == "__main__":
    measure_main(measure, table)
