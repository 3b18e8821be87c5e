"""Ours against transformers' native distributed training (``DistributedConfig``), layout by layout.

Each layout runs twice, as fresh torchrun jobs: ours (``NeMoAutoModelForCausalLM.from_pretrained``
with a ``DistributedSetup`` + ``train_step``) and transformers' own
(``AutoModelForCausalLM.from_pretrained(distributed_config=DistributedConfig(...))`` after
``init_process_group("gloo")``, its in-forward loss, ``backward``, ``step``). Layouts: fsdp (2 ranks),
tp=2 (2 ranks), fsdp × tp (4 ranks, 2 × 2), HSDP (4 ranks, replicate 2 × shard 2) on the ~100M
Llama fp32 (``bench_lora_step``'s checkpoint), and ep=2 (2 ranks) on ``bench_expert_parallel``'s
62M Mixtral-shaped MoE. One process of ours per model is the loss reference.

Every layout trains on the same global batch, ``ROWS`` × ``SEQUENCE`` tokens a step (seeded by the
step number), dealt over its data-parallel ranks (both tp ranks of a group get the same rows);
AdamW lr 1e-4, ``WARMUP`` + ``STEPS`` steps, 1 thread per rank (4-rank jobs oversubscribe the 2
cores of the machine this was written on, as the matmul peak measured alongside them does too).
Per rank: load seconds (``from_pretrained`` until every page of the parameters is written: a
copy-on-write mapping of the file is paid for there, as training would), with both sides' modeling
code imported before timing; peak RSS
(VmHWM) once loaded and after training, the median step, the losses, the fp32 matmul rate, and the
RSS after imports (the memory floor's baseline). A repeat runs every case once, ours and the peer
alternating; ``--repeats N`` (default ``REPEATS``). About 4 minutes a repeat on a quiet 2-core
machine (the four 4-rank jobs take half of it), so ``repeats=3`` takes about 12 minutes.
Run: ``python -m benchmarks.bench_peer [--repeats N]`` or ``python -m benchmarks --only peer``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from benchmarks.bench_expert_parallel import CHECKPOINT_MOE, moe_config
from benchmarks.bench_expert_parallel import _write_checkpoint as make_checkpoint_moe
from benchmarks.bench_lora_step import CHECKPOINT_100M, make_checkpoint_100m
from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import (
    MATMUL_SIZE,
    Table,
    all_runs,
    matmul_rate,
    measure_main,
    memory_floor_mib,
    reset_peak_rss,
    run_measure,
    status_mib,
    touch,
)

ROWS, SEQUENCE, WARMUP, STEPS, REPEATS, LR = 4, 128, 1, 3, 3, 1e-4
TIMEOUT_S = 900
MODULE = "benchmarks.bench_peer"


@dataclass(frozen=True)
class Layout:
    """A layout, as transformers' ``DistributedConfig`` sizes; ours builds the same degrees."""

    label: str
    sizes: dict[str, int] = field(default_factory=dict)
    moe: bool = False

    def size(self, name: str) -> int:
        return self.sizes.get(name, 1)

    @property
    def ranks(self) -> int:
        return self.size("dp_replicate_size") * self.size("fsdp_size") * self.size("tp_size")

    @property
    def dp(self) -> int:
        return self.size("dp_replicate_size") * self.size("fsdp_size")

    @property
    def ours(self) -> dict[str, Any]:
        """``DistributedSetup.build``'s degrees (the FSDP shard degree is derived from the rest)."""
        return {k: v for k, v in self.sizes.items() if k in ("tp_size", "dp_replicate_size", "ep_size")}


LAYOUTS = {
    "fsdp": Layout("fsdp, 2 ranks", {"fsdp_size": 2}),
    "tp": Layout("tp=2, 2 ranks", {"tp_size": 2}),
    "fsdp_tp": Layout("fsdp × tp, 4 ranks (2 × 2)", {"fsdp_size": 2, "tp_size": 2}),
    "hsdp": Layout("HSDP, 4 ranks (replicate 2 × shard 2)", {"dp_replicate_size": 2, "fsdp_size": 2}),
    "ep": Layout("ep=2, 2 ranks, MoE", {"ep_size": 2, "fsdp_size": 2}, moe=True),
}
REFERENCES = {
    "ref-dense": Layout("one process (reference)"),
    "ref-moe": Layout("one process, MoE (reference)", moe=True),
}


def _layout(kind: str) -> Layout:
    return REFERENCES[kind] if kind in REFERENCES else LAYOUTS[kind.split("-", 1)[1]]


def _batch(step: int, dp_rank: int, dp_size: int, vocab: int) -> dict[str, Any]:
    """This data-parallel rank's rows of the step's global batch (the same batch for every layout)."""
    import torch

    rows = torch.randint(0, vocab, (ROWS, SEQUENCE), generator=torch.Generator().manual_seed(step))
    share = ROWS // dp_size
    tokens = rows[dp_rank * share : (dp_rank + 1) * share]
    return {"input_ids": tokens, "labels": tokens}


def _load(kind: str):
    """The model of ``kind``, its (dp rank, dp size), and a function running one step (its loss)."""
    import torch
    import torch.distributed as dist

    layout = _layout(kind)
    path = str(CHECKPOINT_MOE if layout.moe else CHECKPOINT_100M)
    if kind.startswith("peer"):
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        sizes: dict[str, Any] = dict(layout.sizes)
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**sizes))
        touch(model.parameters(), write=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def step(batch: dict[str, Any]) -> Any:
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        tp = layout.size("tp_size")  # transformers' mesh is (pp, dp_replicate, fsdp, tp): tp innermost
        return model, (dist.get_rank() // tp, dist.get_world_size() // tp), step
    from nemo_wrap import DistributedSetup, NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    setup = None if kind in REFERENCES else DistributedSetup.build("fsdp2", layout.ranks, **layout.ours)
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup)
    touch(model.parameters(), write=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    place = (0, 1) if setup is None else (setup.dp_rank(), setup.dp_size)
    return model, place, lambda batch: train_step(model, optimizer, [batch]).loss


def _start(kind: str) -> dict[str, float]:
    """Join the job (ours: ``initialize_distributed``; the peer: ``init_process_group``), one thread;
    the matmul rate, then the baseline RSS and a fresh peak mark."""
    import torch
    import torch.distributed as dist

    # both sides' modeling code is imported before the baseline and the timing, as are ours
    import transformers.models.llama.modeling_llama
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401

    import nemo_wrap
    import nemo_wrap.auto
    import nemo_wrap.training

    torch.set_num_threads(1)
    if kind.startswith("peer"):
        dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    elif kind not in REFERENCES:
        nemo_wrap.initialize_distributed(timeout_s=TIMEOUT_S)
    rate = matmul_rate()
    gc.collect()
    reset_peak_rss()
    return {"matmul_flops": rate, "baseline_mib": status_mib("VmRSS")}


def measure(kind: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    start = _start(kind)
    if dist.is_initialized():
        dist.barrier()
    started = time.perf_counter()
    model, (dp_rank, dp_size), step = _load(kind)
    load_seconds, loaded_mib = time.perf_counter() - started, status_mib("VmHWM")
    model.train()
    vocab = model.config.vocab_size
    times, losses = [], []
    for index in range(WARMUP + STEPS):
        batch = _batch(index, dp_rank, dp_size, vocab)
        began = time.perf_counter()
        losses.append(step(batch))
        if index >= WARMUP:
            times.append(time.perf_counter() - began)
    if kind.startswith("peer"):  # each rank's mean over its rows (equal counts): their mean is the batch's
        local = torch.stack([x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]).float()
        dist.all_reduce(local)
        losses = (local / dist.get_world_size()).tolist()
    return {
        **start,
        "load_seconds": load_seconds,
        "loaded_mib": loaded_mib,
        "peak_mib": status_mib("VmHWM"),
        "step_seconds": statistics.median(times),
        "losses": [float(x) for x in losses],
        "dtype": str(next(model.parameters()).dtype),
    }


def _model_facts(moe: bool) -> dict[str, Any]:
    """From a meta-device copy: the parameters, N of 6·N·tokens (what a token's matmuls use: every
    decoder layer with its experts × top_k / experts, and the lm_head), each FSDP unit's (dense,
    expert) parameters, and the widths of the activation estimate."""
    import torch
    from transformers import AutoModelForCausalLM

    config = moe_config() if moe else llama_100m_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)

    def split(module: Any) -> tuple[int, int]:
        expert = sum(p.numel() for n, p in module.named_parameters() if ".experts." in f".{n}")
        return sum(p.numel() for p in module.parameters()) - expert, expert

    top_k = getattr(config, "num_experts_per_tok", 1)
    share = top_k / getattr(config, "num_local_experts", 1)
    layers = [split(layer) for layer in model.model.layers]
    head = model.lm_head.weight.numel()
    kv = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "flop_params": sum(d + e * share for d, e in layers) + head,
        "units": [*layers, split(model.model.embed_tokens), (head, 0)],
        "widths": (config.hidden_size, kv, config.intermediate_size * top_k, config.vocab_size, len(layers)),
    }


def _floor_mib(facts: dict[str, Any], layout: Layout, baseline_mib: float) -> float:
    """The analytic floor of one rank of ``layout``: state over fsdp × tp (experts: over ep × the
    expert-FSDP degree fsdp·tp/ep, the same), the largest all-gathered unit (tp-sharded parts ÷ tp;
    experts only when expert-FSDP > 1), and activations: per token and layer 4·h fp32 values whole
    (residuals, norms) and (2·h + 2·kv + 4·intermediate·top_k) ÷ tp, plus 2·vocab ÷ tp of logits."""
    tp, fsdp, ep = layout.size("tp_size"), layout.size("fsdp_size"), layout.size("ep_size")
    expert_fsdp = fsdp * tp // ep
    gathered = 0.0
    if fsdp > 1:
        gathered = max(d / tp + (e / ep if expert_fsdp > 1 else 0) for d, e in facts["units"])
    hidden, kv, inner, vocab, layers = facts["widths"]
    per_token = layers * (4 * hidden + (2 * hidden + 2 * kv + 4 * inner) / tp) + 2 * vocab / tp
    activations = 4 * ROWS * SEQUENCE / layout.dp * per_token
    return memory_floor_mib(facts["params"], fsdp * tp, gathered, activations, baseline_mib)


def _ratio_cell(ours: list[list[dict]], peer: list[list[dict]], key: str) -> str:
    """peer ÷ ours of the slowest rank's ``key`` (≥ 1: ours faster): best against best, and the
    min–max of the repeats' paired ratios."""
    pairs = [max(r[key] for r in p) / max(r[key] for r in o) for o, p in zip(ours, peer, strict=True)]
    best = min(max(r[key] for r in p) for p in peer) / min(max(r[key] for r in o) for o in ours)
    spread = f" ({min(pairs):.2f}–{max(pairs):.2f})" if len(pairs) > 1 else ""
    return f"{best:.2f}{spread}"


def _row(label: str, runs: list[list[dict]], facts: dict, layout: Layout, reference: list[float]) -> list[str]:
    """One case's cells, from its fastest run (by the slowest rank's step); the ratio cells are
    filled in by the caller."""
    if "error" in runs[0][0]:
        return [label, str(layout.ranks), f"fails: {runs[0][0]['error']}", *["—"] * 9]
    rows = min(runs, key=lambda rs: max(r["step_seconds"] for r in rs))
    load = min(max(r["load_seconds"] for r in rs) for rs in runs)
    floors = [_floor_mib(facts, layout, r["baseline_mib"]) for r in rows]
    step = max(r["step_seconds"] for r in rows)
    mfu = 6 * facts["flop_params"] * ROWS * SEQUENCE / step / sum(r["matmul_flops"] for r in rows)
    loss = max(abs(a - b) / abs(b) for a, b in zip(rows[0]["losses"], reference, strict=True))
    return [
        label,
        str(layout.ranks),
        f"{load:.1f} s",
        "—",
        " / ".join(f"{r['loaded_mib']:.0f}" for r in rows) + " MiB",
        " / ".join(f"{r['peak_mib']:.0f}" for r in rows) + " MiB",
        " / ".join(f"{f:.0f}" for f in floors) + " MiB",
        f"{max(r['peak_mib'] / f for r, f in zip(rows, floors, strict=True)):.2f}",
        f"{step:.2f} s",
        "—",
        f"{mfu:.0%}",
        f"{loss:.1e}",
    ]


def _note(repeats: int, runs: dict[str, list[list[dict]]]) -> str:
    mm = runs["ref-dense"][0][0]["matmul_flops"] / 1e9
    return (
        f"Fastest of {repeats} interleaved runs (ours, transformers, next layout, …), each a fresh torchrun job; "
        f"step = median of {STEPS} steps after {WARMUP} warm-up, slowest rank; load = from `from_pretrained` until "
        "every parameter page is written (both sides' modeling code imported first), slowest rank. "
        "Speed-ups are transformers' seconds ÷ ours (≥ 1: ours "
        "faster), the fastest runs' against each other, in brackets the min–max of the repeats' paired ratios. "
        "Memory per rank (rank 0 / 1 / …); floor = (parameters + gradients + AdamW's 2 states, fp32) ÷ (fsdp × tp) "
        "+ the largest all-gathered unit + a rough activation estimate + the rank's RSS after "
        "imports; peak ÷ floor is the worst rank's. MFU = 6·N·tokens per step ÷ step ÷ the summed fp32 "
        f"{MATMUL_SIZE}×{MATMUL_SIZE} `torch.mm` rate of the job's ranks, measured alongside each other in the same "
        f"processes (one process, 1 thread: {mm:.0f} GFLOP/s); N = the parameters a token's matmuls use (dense: "
        "all of them, the tied embedding once as the lm_head; MoE: experts × 2/8, no input embedding); tp counts "
        "its tokens once. Loss diff = the largest relative difference of the first "
        f"{WARMUP + STEPS} steps' losses from one process of ours on the same global batch. pp / cp: transformers "
        "has none (its `pp_size` is forward-only, and it has no context parallel); ours has both. accelerate's "
        "FSDP2 plugin (`FullyShardedDataParallelPlugin(fsdp_version=2)`) silently trains under "
        "`DistributedDataParallel` on CPU (`DistributedType.MULTI_CPU`, parameters whole), so it has no row."
    )


def table(repeats: int = REPEATS) -> Table:
    """Every layout, ours and transformers', interleaved ``repeats`` times; one process per model once."""
    make_checkpoint_100m()
    make_checkpoint_moe()
    kinds = [f"{side}-{name}" for name in LAYOUTS for side in ("ours", "peer")]
    runs = {kind: [run_measure(MODULE, kind)] for kind in REFERENCES}
    runs |= all_runs(repeats, MODULE, kinds, {k: _layout(k).ranks for k in kinds}, check=False)
    facts = {moe: _model_facts(moe) for moe in (False, True)}
    result = Table(
        f"training, ours vs transformers' `DistributedConfig`: 100M Llama fp32 (ep: 62M Mixtral-shaped MoE), "
        f"AdamW, {ROWS} × {SEQUENCE} tokens a step in every layout, 1 thread per rank",
        ["ranks", "load", "load speed-up", "peak RSS loaded", "peak RSS training", "floor", "peak ÷ floor",
         "step", "step speed-up", "MFU", "max rel. loss diff"],
        note=_note(repeats, runs),
    )  # fmt: skip
    for kind, layout in REFERENCES.items():
        row = _row(f"{layout.label}, ours", runs[kind], facts[layout.moe], layout, runs[kind][0][0]["losses"])
        result.rows.append([*row[:-1], "reference"])
    for name, layout in LAYOUTS.items():
        reference = runs["ref-moe" if layout.moe else "ref-dense"][0][0]["losses"]
        peer_label = f"{layout.label}, transformers `DistributedConfig({_sizes(layout)})`"
        ours = _row(f"{layout.label}, ours", runs[f"ours-{name}"], facts[layout.moe], layout, reference)
        peer = _row(peer_label, runs[f"peer-{name}"], facts[layout.moe], layout, reference)
        if "fails" not in ours[2] and "fails" not in peer[2]:
            ours[3] = _ratio_cell(runs[f"ours-{name}"], runs[f"peer-{name}"], "load_seconds")
            ours[9] = _ratio_cell(runs[f"ours-{name}"], runs[f"peer-{name}"], "step_seconds")
        result.rows += [ours, peer]
    diffs = [float(row[-1]) for row in result.rows if row[-1] not in ("reference", "—")]
    result.note += f" Largest relative loss difference of any row: {max(diffs):.1e}." if diffs else ""
    return result


def _sizes(layout: Layout) -> str:
    return ", ".join(f"{k}={v}" for k, v in layout.sizes.items())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=REPEATS)
    known, rest = parser.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    measure_main(measure, lambda: table(known.repeats))
