"""Ours against transformers' native distributed training (``DistributedConfig``), layout by layout.

Each layout runs twice, as fresh torchrun jobs: ours (``NeMoAutoModelForCausalLM.from_pretrained``
with a ``DistributedSetup`` + ``train_step``) and transformers' own
(``AutoModelForCausalLM.from_pretrained(distributed_config=DistributedConfig(...))`` after
``init_process_group("gloo")``, its in-forward loss, ``backward``, ``step``). Layouts: fsdp (2 ranks),
tp=2 (2 ranks), fsdp × tp (4 ranks, 2 × 2), HSDP (4 ranks, replicate 2 × shard 2), each on two
dense Llamas fp32 — a 30M one (6 layers, hidden 512, vocabulary 8,192, untied head: the head is
its largest FSDP group, and per-step overheads weigh most) and the ~100M one
(``bench_lora_step``'s checkpoint, tied head) — and ep=2 (2 ranks) on ``bench_expert_parallel``'s
62M Mixtral-shaped MoE (the dense shapes have no experts). One process of ours per model is the
loss reference.

Every layout trains on the same global batch, ``ROWS`` × ``SEQUENCE`` tokens a step (seeded by the
step number), dealt over its data-parallel ranks (both tp ranks of a group get the same rows);
AdamW lr 1e-4, ``WARMUP`` + ``STEPS`` steps, 1 thread per rank (4-rank jobs oversubscribe the 2
cores of the machine this was written on, as the matmul peak measured alongside them does too).
Per rank: load seconds (``from_pretrained`` until every page of the parameters is written: a
copy-on-write mapping of the file is paid for there, as training would), with both sides' modeling
code imported before timing; peak RSS
(VmHWM) once loaded and after training, the median step, the losses, the fp32 matmul rate, the
RSS after imports (the memory floor's baseline), and where one more, profiled, step's time goes
(:func:`step_split`). A repeat runs every case once, ours and the peer alternating; ``--repeats
N`` (default ``REPEATS``). About 7 minutes a repeat on a quiet 2-core machine (the 4-rank jobs
take half of it), so ``repeats=3`` takes about 20 minutes.
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
CHECKPOINT_30M = CHECKPOINT_100M.parent / "llama-30m-fp32"
# ranges of torch's profiler that are communication: c10d's ops and their waits, DTensor's
# functional collectives, FSDP2's all-gather and reduce-scatter (copy-in and copy-out included)
COMMUNICATION = ("c10d::", "_c10d_functional::", "record_param_comms", "FSDP::all_gather", "FSDP::post_backward_reduce")


def llama_30m_config() -> Any:
    """A 30M Llama with its own head: the head (4.2M parameters) is its largest FSDP group."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                       tie_word_embeddings=False)  # fmt: skip


def make_checkpoint_30m() -> None:
    """The 30M Llama (random fp32 weights, seeded), written once."""
    if not (CHECKPOINT_30M / "config.json").exists():
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(llama_30m_config()).save_pretrained(CHECKPOINT_30M)


@dataclass(frozen=True)
class Layout:
    """A layout, as transformers' ``DistributedConfig`` sizes; ours builds the same degrees."""

    label: str
    model: str
    sizes: dict[str, int] = field(default_factory=dict)

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


MODELS = {  # model → (its config, its checkpoint, its writer, its name in the tables)
    "30m": (llama_30m_config, CHECKPOINT_30M, make_checkpoint_30m, "30M Llama"),
    "100m": (llama_100m_config, CHECKPOINT_100M, make_checkpoint_100m, "100M Llama"),
    "moe": (moe_config, CHECKPOINT_MOE, make_checkpoint_moe, "62M MoE"),
}
DENSE_LAYOUTS = {
    "fsdp": ("fsdp, 2 ranks", {"fsdp_size": 2}),
    "tp": ("tp=2, 2 ranks", {"tp_size": 2}),
    "fsdp_tp": ("fsdp × tp, 4 ranks (2 × 2)", {"fsdp_size": 2, "tp_size": 2}),
    "hsdp": ("HSDP, 4 ranks (replicate 2 × shard 2)", {"dp_replicate_size": 2, "fsdp_size": 2}),
}
LAYOUTS = {
    f"{name}_{model}": Layout(f"{MODELS[model][3]}, {label}", model, sizes)
    for model in ("30m", "100m")
    for name, (label, sizes) in DENSE_LAYOUTS.items()
}
LAYOUTS["ep_moe"] = Layout("62M MoE, ep=2, 2 ranks", "moe", {"ep_size": 2, "fsdp_size": 2})
REFERENCES = {f"ref-{model}": Layout(f"{MODELS[model][3]}, one process (reference)", model) for model in MODELS}


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
    path = str(MODELS[layout.model][1])
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
    peak_mib = status_mib("VmHWM")  # before the profiled step: the profiler's records are not the step's
    split = step_split(step, _batch(WARMUP + STEPS, dp_rank, dp_size, vocab))
    if kind.startswith("peer"):  # each rank's mean over its rows (equal counts): their mean is the batch's
        local = torch.stack([x.full_tensor() if hasattr(x, "full_tensor") else x for x in losses]).float()
        dist.all_reduce(local)
        losses = (local / dist.get_world_size()).tolist()
    return {
        **start,
        "load_seconds": load_seconds,
        "loaded_mib": loaded_mib,
        "peak_mib": peak_mib,
        "step_seconds": statistics.median(times),
        "split": split,
        "losses": [float(x) for x in losses],
        "dtype": str(next(model.parameters()).dtype),
    }


def step_split(step: Any, batch: dict[str, Any]) -> dict[str, float]:
    """Where one step's time goes on this rank: its main thread's time under torch's profiler, each
    event's own (self) time counted once, under the first of these its ranges fall in: ``ours``
    (nemo_wrap's own ``nemo_wrap::`` ranges: counting the label tokens, reducing the loss),
    ``optimizer`` (torch's ``Optimizer.step`` / ``zero_grad`` ranges), ``communication``
    (:data:`COMMUNICATION`: collectives and their waits, FSDP2's gathers and reduce-scatters with
    their copies), else ``compute``. Shares of the profiled step, which the profiler slows alike."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as profiled, record_function("bench::step"):
        step(batch)
    events = profiled.events()
    root = next(e for e in events if e.name == "bench::step")
    shares = dict.fromkeys(("compute", "communication", "optimizer", "ours"), 0.0)
    for event in events:
        names, parent = [event.name], event.cpu_parent
        while parent is not None:
            names.append(parent.name)
            parent = parent.cpu_parent
        if names[-1] != "bench::step" or event is root:
            continue
        shares[_category(names)] += event.self_cpu_time_total
    total = root.cpu_time_total
    shares["compute"] += root.self_cpu_time_total
    return {name: value / total for name, value in shares.items()}


def _category(names: list[str]) -> str:
    """The category of an event whose ranges, innermost first, are ``names``."""
    if any(name.startswith("nemo_wrap::") for name in names):
        return "ours"
    if any(name.startswith("Optimizer.") for name in names):
        return "optimizer"
    if any(name.startswith(COMMUNICATION) for name in names):
        return "communication"
    return "compute"


def _model_facts(model_name: str) -> dict[str, Any]:
    """From a meta-device copy: the parameters, N of 6·N·tokens (what a token's matmuls use: every
    decoder layer with its experts × top_k / experts, and the lm_head), each FSDP unit's (dense,
    expert) parameters, and the widths of the activation estimate."""
    import torch
    from transformers import AutoModelForCausalLM

    config = MODELS[model_name][0]()
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
        return [label, str(layout.ranks), f"fails: {runs[0][0]['error']}", *["—"] * 11]
    rows = _fastest(runs)
    load = min(max(r["load_seconds"] for r in rs) for rs in runs)
    floors = [_floor_mib(facts, layout, r["baseline_mib"]) for r in rows]
    step = max(r["step_seconds"] for r in rows)
    mfu = 6 * facts["flop_params"] * ROWS * SEQUENCE / step / sum(r["matmul_flops"] for r in rows)
    loss = max(abs(a - b) / abs(b) for a, b in zip(rows[0]["losses"], reference, strict=True))
    split = max(rows, key=lambda r: r["step_seconds"])["split"]  # the slowest rank's
    return [
        label,
        str(layout.ranks),
        f"{load:.1f} s",
        "—",
        " / ".join(f"{r['loaded_mib']:.0f}" for r in rows) + " MiB",
        " / ".join(f"{r['peak_mib']:.0f}" for r in rows) + " MiB",
        " / ".join(f"{f:.0f}" for f in floors) + " MiB",
        f"{max(r['peak_mib'] / f for r, f in zip(rows, floors, strict=True)):.2f}",
        "—",
        f"{step:.2f} s",
        "—",
        " · ".join(f"{split[name]:.0%}" for name in ("compute", "communication", "optimizer", "ours")),
        f"{mfu:.0%}",
        f"{loss:.1e}",
    ]


def _fastest(runs: list[list[dict]]) -> list[dict]:
    """The run (its ranks' rows) whose slowest rank's step was fastest."""
    return min(runs, key=lambda rs: max(r["step_seconds"] for r in rs))


def _peak_cell(ours: list[list[dict]], peer: list[list[dict]]) -> str:
    """peer ÷ ours of the worst rank's peak RSS in each side's fastest run (≥ 1: ours smaller)."""
    fastest = [_fastest(runs) for runs in (ours, peer)]
    return f"{max(r['peak_mib'] for r in fastest[1]) / max(r['peak_mib'] for r in fastest[0]):.2f}"


def _note(repeats: int, runs: dict[str, list[list[dict]]]) -> str:
    mm = runs["ref-100m"][0][0]["matmul_flops"] / 1e9
    return (
        f"Fastest of {repeats} interleaved runs (ours, transformers, next layout, …), each a fresh torchrun job; "
        f"step = median of {STEPS} steps after {WARMUP} warm-up, slowest rank; load = from `from_pretrained` until "
        "every parameter page is written (both sides' modeling code imported first), slowest rank. "
        "Speed-ups are transformers' seconds ÷ ours (≥ 1: ours "
        "faster), the fastest runs' against each other, in brackets the min–max of the repeats' paired ratios. "
        "Memory per rank (rank 0 / 1 / …); floor = (parameters + gradients + AdamW's 2 states, fp32) ÷ (fsdp × tp) "
        "+ the largest all-gathered unit + a rough activation estimate + the rank's RSS after "
        "imports; peak ÷ floor is the worst rank's; peak vs transformers = its worst rank's peak ÷ ours (≥ 1: ours "
        "smaller). Step split (slowest rank, one more step under torch's profiler, shares of it): compute · "
        "communication (collectives and their waits, FSDP2's gathers and reduce-scatters with their copies) · the "
        "optimizer (step and zero_grad) · ours (counting the label tokens, reducing the loss). "
        "MFU = 6·N·tokens per step ÷ step ÷ the summed fp32 "
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
    for _, _, make_checkpoint, _ in MODELS.values():
        make_checkpoint()
    kinds = [f"{side}-{name}" for name in LAYOUTS for side in ("ours", "peer")]
    runs = {kind: [run_measure(MODULE, kind)] for kind in REFERENCES}
    runs |= all_runs(repeats, MODULE, kinds, {k: _layout(k).ranks for k in kinds}, check=False)
    facts = {model: _model_facts(model) for model in MODELS}
    result = Table(
        f"training, ours vs transformers' `DistributedConfig`: 30M and 100M Llamas fp32, ep on a 62M "
        f"Mixtral-shaped MoE, AdamW, {ROWS} × {SEQUENCE} tokens a step in every layout, 1 thread per rank",
        ["ranks", "load", "load speed-up", "peak RSS loaded", "peak RSS training", "floor", "peak ÷ floor",
         "peak vs transformers", "step", "step speed-up", "step split: compute · communication · optimizer · ours",
         "MFU", "max rel. loss diff"],
        note=_note(repeats, runs),
    )  # fmt: skip
    for kind, layout in REFERENCES.items():
        row = _row(f"{layout.label}, ours", runs[kind], facts[layout.model], layout, runs[kind][0][0]["losses"])
        result.rows.append([*row[:-1], "reference"])
    for name, layout in LAYOUTS.items():
        reference = runs[f"ref-{layout.model}"][0][0]["losses"]
        ours_runs, peer_runs = runs[f"ours-{name}"], runs[f"peer-{name}"]
        peer_label = f"{layout.label}, transformers `DistributedConfig({_sizes(layout)})`"
        ours = _row(f"{layout.label}, ours", ours_runs, facts[layout.model], layout, reference)
        peer = _row(peer_label, peer_runs, facts[layout.model], layout, reference)
        if "fails" not in ours[2] and "fails" not in peer[2]:
            ours[3] = _ratio_cell(ours_runs, peer_runs, "load_seconds")
            ours[8] = _peak_cell(ours_runs, peer_runs)
            ours[10] = _ratio_cell(ours_runs, peer_runs, "step_seconds")
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
