"""``precision=``: step time and per-rank memory of fp32, bf16-mixed and bf16, fsdp2 on 2 ranks.

The ~100M Llama of :mod:`benchmarks.bench_training_step`, 2 ranks × 1 thread, one row of 256
tokens per rank, AdamW. Memory is per rank, above the process's RSS after imports and the process
group: the bytes of the local parameter shards and their optimizer state (counted exactly), the
peak RSS of the run, the analytic floor (``common.memory_floor_mib``: state and gradients over 2,
the largest layer gathered, the step's activations) and what glibc's allocator
held in use (heap in use + mapped chunks, sampled after each forward, backward and optimizer step).
The gap between the peak and the allocator's use is memory freed but kept by glibc for the next
step; the last row sets ``MALLOC_TRIM_THRESHOLD_=0`` so freed memory goes back at once, to show
what that costs in step time. Whether bf16 compute is faster than fp32 depends on the CPU
(AVX512-BF16 / AMX); MFU is against a ``torch.mm`` rate in the compute dtype, timed in the same job.
Run: ``python -m benchmarks.bench_precision``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import Table, matmul_rate, measure_main, memory_floor_mib, run_measure, status_mib

MODULE = "benchmarks.bench_precision"
TOKENS, STEPS = 256, 3
KINDS = {"fp32": "fp32", "bf16-mixed": "bf16-mixed", "bf16": "bf16", "fp32-trim": "fp32"}
TRIM = {"MALLOC_TRIM_THRESHOLD_": "0"}  # glibc hands freed memory back at once


def _allocator_mib() -> float:
    """What glibc's malloc holds in use right now: heap chunks in use plus mapped chunks (mallinfo2)."""
    import ctypes

    class Info(ctypes.Structure):
        fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
        _fields_ = [(name, ctypes.c_size_t) for name in (*fields, "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def _activation_bytes(precision: str) -> float:
    """A lower bound on one 256-token row's activations kept for backward: per layer the residual,
    norm, q/k/v, attention output and the MLP's three projections, plus the logits and their grad."""
    config = llama_100m_config()
    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    per_token = config.num_hidden_layers * (4 * hidden + 2 * kv + 3 * inner) + 2 * config.vocab_size
    return TOKENS * per_token * (2 if precision == "bf16" else 4)


def measure(kind: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    env = initialize_distributed()
    precision = KINDS[kind]
    compute = torch.float32 if precision == "fp32" else torch.bfloat16
    peak_rate = matmul_rate(compute)
    baseline, allocator_baseline = status_mib("VmHWM"), _allocator_mib()
    setup = DistributedSetup.build("fsdp2", env.world_size)
    model = NeMoAutoModelForCausalLM.from_config(llama_100m_config(), setup, seed=0, precision=precision).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(env.rank))
    times, in_use = [], []
    for step in range(1 + STEPS):
        dist.barrier()
        started = time.perf_counter()
        loss = model(tokens, labels=tokens).loss
        in_use.append(_allocator_mib())
        loss.backward()
        in_use.append(_allocator_mib())
        optimizer.step()
        in_use.append(_allocator_mib())
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
    parameters = sum(p.numel() for p in model.parameters())
    local = [t.to_local() for t in model.parameters()]
    local += [s.to_local() for state in optimizer.state.values() for s in state.values() if s.dim()]
    largest = model.lm_head.weight.numel()  # the largest unit gathered: the tied embedding / lm_head
    scale = 0.5 if precision == "bf16" else 1.0  # memory_floor_mib counts fp32 bytes
    activations = _activation_bytes(precision)
    floor = memory_floor_mib(parameters * scale, env.world_size, largest * scale, activations, 0)
    step_seconds = statistics.median(times)
    return {"seconds": step_seconds, "peak_mib": status_mib("VmHWM") - baseline,
            "state_mib": sum(t.numel() * t.element_size() for t in local) / 2**20, "floor_mib": floor,
            "allocator_mib": max(in_use) - allocator_baseline,
            "mfu": 6 * parameters * TOKENS / step_seconds / peak_rate}  # fmt: skip


def table() -> Table:
    result = Table(
        f"fsdp2 on 2 ranks, 100M Llama, {TOKENS} tokens per rank, AdamW",
        [
            "step",
            "MFU",
            "parameters + optimizer state per rank",
            "peak RSS per rank",
            "floor",
            "peak / floor",
            "in use by the allocator (sampled)",
        ],
        note=f"Median of {STEPS} steps after a warm-up step; the slower rank's numbers; memory above the RSS after "
        "imports. Floor: parameters, gradients and AdamW state over 2 ranks, the largest unit gathered (the tied "
        "embedding / lm_head), and the activations of the step's row. MFU: 6 · parameters · "
        "tokens a rank ÷ that rank's `torch.mm` rate in the compute dtype.",
    )
    for kind, precision in KINDS.items():
        rows = run_measure(MODULE, kind, nproc=2, env=TRIM if kind.endswith("trim") else None)
        worst = {key: max(row[key] for row in rows) for key in ("seconds", "state_mib", "peak_mib", "floor_mib",
                                                                "allocator_mib")}  # fmt: skip
        label = f'`precision="{precision}"`' + (", `MALLOC_TRIM_THRESHOLD_=0`" if kind.endswith("trim") else "")
        result.rows.append([label, f"{worst['seconds']:.2f} s", f"{min(row['mfu'] for row in rows):.0%}",
                            f"{worst['state_mib']:.0f} MiB", f"{worst['peak_mib']:.0f} MiB",
                            f"{worst['floor_mib']:.0f} MiB", f"{worst['peak_mib'] / worst['floor_mib']:.2f}",
                            f"{worst['allocator_mib']:.0f} MiB"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
