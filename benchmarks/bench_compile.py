"""``compile=True`` (``torch.compile`` per decoder layer): does it pay on this machine?

One process, the ~100M Llama of :mod:`benchmarks.bench_training_step`, fp32, 2 × 256 tokens,
AdamW, ``from_config(..., compile=kind == "compiled")`` (each layer compiled in place; the layers
share one graph). Reports the first step (which compiles, unless inductor's on-disk cache already
holds the graph) and the median of the next steps. Run: ``python -m benchmarks.bench_compile``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import Table, measure_main, run_measure

MODULE = "benchmarks.bench_compile"
BATCH, SEQUENCE, STEPS = 2, 256, 4


def measure(kind: str) -> dict[str, Any]:
    import torch

    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    model = NeMoAutoModelForCausalLM.from_config(llama_100m_config(), seed=0, compile=kind == "compiled").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 32000, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    times, losses = [], []
    for _ in range(1 + STEPS):
        started = time.perf_counter()
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
    return {"first": times[0], "seconds": statistics.median(times[1:]), "losses": losses}


def table() -> Table:
    rows = {kind: run_measure(MODULE, kind)[0] for kind in ("eager", "compiled")}
    eager, compiled = rows["eager"], rows["compiled"]
    drift = max(abs(a - b) / a for a, b in zip(eager["losses"], compiled["losses"], strict=True))
    return Table(
        f"training step, 100M Llama fp32, one process, {BATCH} × {SEQUENCE} tokens",
        ["first step", "later steps (median)"],
        [
            ["eager", f"{eager['first']:.1f} s", f"{eager['seconds']:.2f} s"],
            ["`compile=True`", f"{compiled['first']:.1f} s", f"{compiled['seconds']:.2f} s"],
        ],
        note=f"Losses of the two agree to {drift:.1e} (relative) over {1 + STEPS} steps.",
    )


if __name__ == "__main__":
    measure_main(measure, table)
