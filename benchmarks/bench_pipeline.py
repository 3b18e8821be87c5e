"""Pipeline parallel on 2 CPU ranks: per-rank memory against fsdp2, and 1F1B against GPipe.

The ~100M-parameter Llama of the LoRA benchmark (fp32, 12 layers, tied embeddings, saved once), 2
ranks × 1 thread, AdamW, one global batch of 8 × 256 tokens per step. Under fsdp2 each rank takes 4
rows as one micro-batch (data parallel); under pp=2 both ranks see the 8 rows as 4 micro-batches
of 2 (each stage holds 6 layers and one end of the model). Reported per rank: peak RSS once
loaded (``from_pretrained``, every page touched) and after the training steps, and the median step
time. The user's alternative to our pipeline is fsdp2 (transformers 5.24's own ``pp_size`` cannot
train: its first stage's loss is ``None``). Run: ``python -m benchmarks.bench_pipeline``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.bench_lora_step import CHECKPOINT_100M
from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import Table, best_of, measure_main, per_rank_memory_cells, status_mib, touch

ROWS, SEQUENCE, WARMUP, STEPS = 8, 256, 1, 3
MODULE = "benchmarks.bench_pipeline"
LABELS = {
    "fsdp2": "ours, fsdp2 (dp=2)",
    "pp-gpipe": "ours, pp=2, GPipe",
    "pp-1f1b": "ours, pp=2, 1F1B",
}


def _micro_batches(kind: str, step: int, dp_rank: int) -> list[dict[str, Any]]:
    import torch

    rows = torch.randint(0, 32000, (ROWS, SEQUENCE), generator=torch.Generator().manual_seed(step))
    if kind == "fsdp2":
        return [{"input_ids": rows[dp_rank * 4 : dp_rank * 4 + 4]}]
    return [{"input_ids": rows[i : i + 2]} for i in range(0, ROWS, 2)]


def measure(kind: str) -> dict[str, Any]:
    import torch

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    env = initialize_distributed()
    pipeline = {"pp_size": 2, "pp_schedule": kind.removeprefix("pp-")} if kind.startswith("pp") else {}
    setup = DistributedSetup.build("fsdp2", env.world_size, **pipeline)
    model = NeMoAutoModelForCausalLM.from_pretrained(str(CHECKPOINT_100M), distributed_setup=setup)
    touch(model.parameters())
    loaded_mib = status_mib("VmHWM")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(WARMUP + STEPS):
        started = time.perf_counter()
        train_step(model, optimizer, _micro_batches(kind, step, setup.dp_rank()))
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    return {"seconds": statistics.median(times), "loaded_mib": loaded_mib, "peak_mib": status_mib("VmHWM")}


def table(repeats: int = 2) -> Table:
    if not (CHECKPOINT_100M / "config.json").exists():
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(llama_100m_config()).save_pretrained(CHECKPOINT_100M)
    best = best_of(repeats, MODULE, list(LABELS), nproc=dict.fromkeys(LABELS, 2))
    result = Table(
        f"100M Llama fp32, 2 ranks × 1 thread, AdamW, {ROWS} × {SEQUENCE} tokens per step",
        ["peak RSS loaded (rank 0 / 1)", "peak RSS training", "vs fsdp2", "step", "vs GPipe"],
        note=f"Best of {repeats} runs; median of {STEPS} steps after {WARMUP} warm-up; each case a fresh torchrun job.",
    )
    fsdp_peak = max(row["peak_mib"] for row in best["fsdp2"])
    gpipe_step = max(row["seconds"] for row in best["pp-gpipe"])
    for kind, label in LABELS.items():
        cells, seconds = per_rank_memory_cells(best[kind], fsdp_peak)
        versus_gpipe = f"{seconds / gpipe_step:.2f}" if kind.startswith("pp") else "—"
        result.rows.append([label, *cells, versus_gpipe])
    return result


if __name__ == "__main__":
    measure_main(measure, table)
