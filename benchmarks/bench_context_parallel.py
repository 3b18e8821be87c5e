"""Context parallel at a long sequence: per-rank peak memory and step time for cp = 1, 2 and 4.

A small Llama (4 layers, 256 wide, vocab 8192, fp32) trains on one 8,192-token sequence per step,
AdamW, activation checkpointing on, 1 thread per rank. cp=1 is one process holding the whole
sequence (what a user has without context parallel); cp=2 and cp=4 are 2 and 4 gloo ranks, each
keeping its load-balanced part of the sequence. "activations" is a rank's peak RSS during the
steps minus its RSS once the model and optimizer state exist. Goal: cp=2's ≤ 0.6× cp=1's. Run:
``python -m benchmarks.bench_context_parallel``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.common import Table, best_of, measure_main, reset_peak_rss, status_mib

SEQUENCE, WARMUP, STEPS = 8192, 1, 2
MODULE = "benchmarks.bench_context_parallel"
SIZES = {"cp1": 1, "cp2": 2, "cp4": 4}


def small_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=SEQUENCE,
                       architectures=["LlamaForCausalLM"])  # fmt: skip


def measure(kind: str) -> dict[str, Any]:
    import torch

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    torch.set_num_threads(1)  # every case on one thread per rank
    size = SIZES[kind]
    setup = None
    if size > 1:
        env = initialize_distributed()
        setup = DistributedSetup.build("fsdp2", env.world_size, cp_size=size)
    model = NeMoAutoModelForCausalLM.from_config(small_llama_config(), distributed_setup=setup, seed=0)
    model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (1, SEQUENCE), generator=torch.Generator().manual_seed(0))
    train_step(model, optimizer, [{"input_ids": tokens}])  # optimizer state exists from here on
    settled_mib = status_mib("VmRSS")
    reset_peak_rss()
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        train_step(model, optimizer, [{"input_ids": tokens}])
        times.append(time.perf_counter() - started)
    peak = status_mib("VmHWM")
    return {"seconds": statistics.median(times), "peak_mib": peak, "activations_mib": peak - settled_mib}


def table(repeats: int = 1) -> Table:
    best = best_of(repeats, MODULE, list(SIZES), nproc=SIZES)
    result = Table(
        f"training step on one {SEQUENCE:,}-token sequence, 4-layer 256-wide Llama fp32, activation checkpointing",
        ["ranks", "peak RSS per rank", "activations per rank", "vs cp=1", "step"],
        note=f"Median of {STEPS} steps after {WARMUP} warm-up, the slowest rank's; 1 thread per rank.",
    )
    baseline = max(row["activations_mib"] for row in best["cp1"])
    for kind, size in SIZES.items():
        rows = best[kind]
        activations = max(row["activations_mib"] for row in rows)
        label = "one process, no context parallel" if size == 1 else f"ours, cp={size}"
        result.rows.append([label, str(size), f"{max(row['peak_mib'] for row in rows):.0f} MiB",
                            f"{activations:.0f} MiB", f"{activations / baseline:.2f}",
                            f"{max(row['seconds'] for row in rows):.1f} s"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
