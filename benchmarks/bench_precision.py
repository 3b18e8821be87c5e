"""``precision=``: step time and per-rank memory of fp32, bf16-mixed and bf16, fsdp2 on 2 ranks.

The ~100M Llama of :mod:`benchmarks.bench_training_step`, 2 ranks × 1 thread, one row of 256
tokens per rank, AdamW. Memory is per rank: the bytes of the local parameter shards and their
optimizer state (counted exactly), and the peak RSS of the whole run above the process's RSS after
imports and the process group (the state plus gathered layers, activations and gradients). This
CPU has no native bf16 matmul (no AVX512-BF16 / AMX), so bf16 compute is slower here than fp32; on
GPUs it is the other way.
Run: ``python -m benchmarks.bench_precision``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import Table, measure_main, run_measure, status_mib

MODULE = "benchmarks.bench_precision"
TOKENS, STEPS = 256, 3
KINDS = ("fp32", "bf16-mixed", "bf16")


def measure(kind: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    env = initialize_distributed()
    baseline = status_mib("VmHWM")
    setup = DistributedSetup.build("fsdp2", env.world_size)
    model = NeMoAutoModelForCausalLM.from_config(llama_100m_config(), setup, seed=0, precision=kind).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(env.rank))
    times = []
    for step in range(1 + STEPS):
        dist.barrier()
        started = time.perf_counter()
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
    local = [t.to_local() for t in model.parameters()]
    local += [s.to_local() for state in optimizer.state.values() for s in state.values() if s.dim()]
    return {"seconds": statistics.median(times), "peak_mib": status_mib("VmHWM") - baseline,
            "state_mib": sum(t.numel() * t.element_size() for t in local) / 2**20}  # fmt: skip


def table() -> Table:
    result = Table(
        f"fsdp2 on 2 ranks, 100M Llama, {TOKENS} tokens per rank, AdamW",
        ["step", "parameters + optimizer state per rank", "peak RSS per rank"],
        note=f"Median of {STEPS} steps after a warm-up step; the slower rank's numbers.",
    )
    for kind in KINDS:
        rows = run_measure(MODULE, kind, nproc=2)
        worst = {key: max(row[key] for row in rows) for key in ("seconds", "state_mib", "peak_mib")}
        result.rows.append([f"`precision=\"{kind}\"`", f"{worst['seconds']:.2f} s", f"{worst['state_mib']:.0f} MiB",
                            f"{worst['peak_mib']:.0f} MiB"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
