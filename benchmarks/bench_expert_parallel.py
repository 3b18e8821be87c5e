"""Expert parallel on 2 CPU ranks: step time and per-rank memory against fsdp2, and the MoE save.

A Mixtral-shaped MoE (fp32, 4 layers, hidden 512, 8 experts of 1024 per layer, top-2, vocab 8192:
62M parameters, 81% of them experts — as in real MoEs, a decoder layer outweighs the embedding),
saved once by transformers (per-expert tensors). 2 ranks × 1 thread, AdamW, 4 × 256 tokens per
rank per step. Under fsdp2 every rank all-gathers every expert of a layer for its forward and
backward; under ep=2 each rank holds 4 whole experts per layer and tokens travel to them by
all-to-all. transformers' own ``DistributedConfig(ep_size=2, fsdp_size=2)`` is the user's
alternative, trained with its in-forward loss.

The save rows: rank 0's RSS growth during ``save_pretrained`` of the ep=2 model, against its
largest layer (a decoder layer's tensors, or the embedding's, whole) — ours streams each gathered
tensor into its file; transformers' ``save_pretrained`` under its ``DistributedConfig`` gathers the
full state dict first. Run: ``python -m benchmarks.bench_expert_parallel`` (training) or
``python -m benchmarks --only moe_save``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from benchmarks.bench_from_pretrained import CHECKPOINT
from benchmarks.common import (
    Table,
    best_of,
    measure_main,
    per_rank_memory_cells,
    reset_peak_rss,
    run_measure,
    status_mib,
    touch,
)

ROWS, SEQUENCE, WARMUP, STEPS = 4, 256, 1, 5
MODULE = "benchmarks.bench_expert_parallel"
CHECKPOINT_MOE = CHECKPOINT.parent / "mixtral-62m-fp32"
TRAINING = {
    "fsdp2": "ours, fsdp2 (experts FSDP-sharded)",
    "ep2": "ours, ep=2",
    "hf-ep2": "transformers DistributedConfig(ep_size=2, fsdp_size=2)",
}
SAVES = {
    "save-ep2": "ours, ep=2: save_pretrained",
    "save-ep2-mmap": "ours, ep=2, MALLOC_MMAP_THRESHOLD_=1 MiB",
    "save-hf-ep2": "transformers, ep=2: save_pretrained",
}
# glibc raises its mmap threshold after large frees, so freed tensors may stay in the heap and count
# towards the peak: a fixed threshold shows what the save itself holds.
_SAVE_ENV = {"save-ep2-mmap": {"MALLOC_MMAP_THRESHOLD_": str(2**20)}}


def moe_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
    )  # fmt: skip


def _batch(step: int, rank: int) -> dict[str, Any]:
    import torch

    rows = torch.randint(0, 8192, (2 * ROWS, SEQUENCE), generator=torch.Generator().manual_seed(step))
    return {"input_ids": rows[rank * ROWS : (rank + 1) * ROWS], "labels": rows[rank * ROWS : (rank + 1) * ROWS]}


def _load(kind: str):
    """The model of ``kind`` on this rank, every page touched; and a function running one step."""
    import torch
    import torch.distributed as dist

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    env = initialize_distributed()
    if kind.endswith("hf-ep2"):
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=2, ep_size=2)
        model = AutoModelForCausalLM.from_pretrained(str(CHECKPOINT_MOE), distributed_config=config)
    else:
        setup = DistributedSetup.build("fsdp2", env.world_size, ep_size=1 if kind == "fsdp2" else 2)
        model = NeMoAutoModelForCausalLM.from_pretrained(str(CHECKPOINT_MOE), distributed_setup=setup)
    touch(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(index: int) -> None:
        batch = _batch(index, dist.get_rank())
        if kind.endswith("hf-ep2"):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            train_step(model, optimizer, [batch])

    return model, step


def measure(kind: str) -> dict[str, Any]:
    model, step = _load(kind)
    loaded_mib = status_mib("VmHWM")
    if kind in SAVES:
        return _measure_save(model, step)
    times = []
    for index in range(WARMUP + STEPS):
        started = time.perf_counter()
        step(index)
        if index >= WARMUP:
            times.append(time.perf_counter() - started)
    return {"seconds": statistics.median(times), "loaded_mib": loaded_mib, "peak_mib": status_mib("VmHWM")}


def _measure_save(model, step) -> dict[str, Any]:
    """Rank 0's RSS growth during the save, after one step (optimizer state and gradients exist)."""
    import gc

    step(0)
    gc.collect()
    with tempfile.TemporaryDirectory() as target:
        reset_peak_rss()
        baseline = status_mib("VmRSS")
        started = time.perf_counter()
        model.save_pretrained(target)
        seconds = time.perf_counter() - started
        growth = status_mib("VmHWM") - baseline
    modules = [*model.model.layers, model.model.embed_tokens, model.lm_head]
    layer_mib = max(sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules) / 2**20  # global
    return {"seconds": seconds, "growth_mib": growth, "layer_mib": layer_mib, "baseline_mib": baseline}


def _write_checkpoint() -> None:
    if not (CHECKPOINT_MOE / "config.json").exists():
        import torch
        from transformers import MixtralForCausalLM

        torch.manual_seed(0)
        MixtralForCausalLM(moe_config()).save_pretrained(CHECKPOINT_MOE)


def table(repeats: int = 2) -> Table:
    """Training: step time and per-rank peak memory, ep=2 against fsdp2 and transformers' EP."""
    _write_checkpoint()
    best = best_of(repeats, MODULE, list(TRAINING), nproc=dict.fromkeys(TRAINING, 2))
    result = Table(
        f"Mixtral-shaped MoE fp32 (62M, 8 experts × 4 layers), 2 ranks × 1 thread, AdamW, {ROWS} × {SEQUENCE} "
        "tokens per rank per step",
        ["peak RSS loaded (rank 0 / 1)", "peak RSS training", "vs fsdp2", "step", "vs fsdp2"],
        note=f"Best of {repeats} runs; median of {STEPS} steps after {WARMUP} warm-up; each case a fresh torchrun job.",
    )
    fsdp_peak = max(row["peak_mib"] for row in best["fsdp2"])
    fsdp_step = max(row["seconds"] for row in best["fsdp2"])
    for kind, label in TRAINING.items():
        cells, seconds = per_rank_memory_cells(best[kind], fsdp_peak)
        result.rows.append([label, *cells, f"{seconds / fsdp_step:.2f}"])
    return result


def save_table(repeats: int = 5) -> Table:
    """The consolidated save's rank-0 peak, ours against transformers'."""
    _write_checkpoint()
    result = Table(
        "consolidated save of the same MoE under ep=2 (2 ranks), rank 0",
        ["RSS before", "growth during the save", "largest layer (full)", "growth / layer", "save"],
        note=f"Median (range) of {repeats} runs, each a fresh torchrun job, after one training step; growth = peak "
        "RSS during save_pretrained − RSS before it. With glibc's default (dynamic) mmap threshold, freed tensors "
        "may stay in the heap and count again, so the default row varies; a fixed threshold shows what the save holds.",
    )
    for kind, label in SAVES.items():
        env = _SAVE_ENV.get(kind)
        runs = sorted((run_measure(MODULE, kind, 2, env)[0] for _ in range(repeats)), key=lambda r: r["growth_mib"])
        # a growth below 0 (RSS before the save held heap pages it reused) is no growth
        row, low, high = runs[len(runs) // 2], max(runs[0]["growth_mib"], 0.0), runs[-1]["growth_mib"]
        growth, layer = row["growth_mib"], row["layer_mib"]
        result.rows.append([label, f"{row['baseline_mib']:.0f} MiB", f"{growth:.0f} MiB ({low:.0f}–{high:.0f})",
                            f"{layer:.0f} MiB", f"{growth / layer:.2f} ({low / layer:.2f}–{high / layer:.2f})",
                            f"{row['seconds']:.2f} s"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)  # (--measure runs save kinds too; the save table prints via benchmarks)
