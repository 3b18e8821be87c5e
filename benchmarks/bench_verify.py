"""What ``verify=True`` adds to a load: the 1.1B bf16 benchmark checkpoint and the real SmolLM2-135M fp32.

Each case is ``from_pretrained`` in a fresh process (or a fresh 2-rank torchrun job under fsdp2),
timed from the call to every page of the weights touched, with and without ``verify``; all cases
alternate (``common.all_runs``), and each repeat gives one ratio. The checkpoint keeps its dtype (``dtype="auto"``).
Goal: verify ≤ 1.3× the load alone on both checkpoints, in one process and per rank on 2 ranks.
Run: ``python -m benchmarks.bench_verify``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.bench_from_pretrained import CHECKPOINT, make_checkpoint
from benchmarks.common import Table, all_runs, measure_main, touch

MODULE = "benchmarks.bench_verify"
CHECKPOINTS = {"1b": "1.1B Llama, bf16, 3 shards", "smollm2": "SmolLM2-135M-Instruct, fp32"}
LAYOUTS = {"one": ("one process", 1), "fsdp2": ("fsdp2 on 2 ranks (per rank)", 2)}


def _path(checkpoint: str) -> Path:
    from nemo_wrap.default_model.smollm2 import smollm2_instruct_path

    return CHECKPOINT if checkpoint == "1b" else smollm2_instruct_path()


def measure(kind: str) -> dict[str, Any]:
    """``kind`` is ``CHECKPOINT-LAYOUT-plain`` or ``CHECKPOINT-LAYOUT-verify``."""
    from transformers import LlamaForCausalLM  # noqa: F401 - the modeling code is imported before timing

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    checkpoint, layout, mode = kind.split("-")
    setup = None
    if layout == "fsdp2":  # the process group is joined before timing
        setup = DistributedSetup.build("fsdp2", initialize_distributed().world_size)
    path = _path(checkpoint)
    started = time.perf_counter()
    model = NeMoAutoModelForCausalLM.from_pretrained(path, setup, dtype="auto", verify=mode == "verify")
    touch(model.parameters())
    return {"seconds": time.perf_counter() - started, "verified": model.load_report.verified}


def table(repeats: int = 3) -> Table:
    make_checkpoint()
    _path("smollm2")  # converted once, before any timing
    result = Table(
        "`verify=True` against the load alone",
        ["load", "load + verify", "verify / load (best)", "spread over repeats"],
        note=f"Best of {repeats} alternating fresh processes (2 ranks: the slower rank), from the call to every "
        "page of the weights touched; the spread is each repeat's own ratio. Goal: ≤ 1.3.",
    )
    cases = [(c, layout, mode) for c in CHECKPOINTS for layout in LAYOUTS for mode in ("plain", "verify")]
    kinds = ["-".join(case) for case in cases]
    runs = all_runs(repeats, MODULE, kinds, {"-".join(case): LAYOUTS[case[1]][1] for case in cases})
    for kind, (_, _, mode) in zip(kinds, cases, strict=True):
        assert all(bool(row["verified"]) == (mode == "verify") for rows in runs[kind] for row in rows)
    for checkpoint, name in CHECKPOINTS.items():
        for layout, (label, _) in LAYOUTS.items():
            times = {mode: [max(row["seconds"] for row in rows) for rows in runs[f"{checkpoint}-{layout}-{mode}"]]
                     for mode in ("plain", "verify")}  # fmt: skip
            ratios = [v / p for p, v in zip(times["plain"], times["verify"], strict=True)]
            best_plain, best_verify = min(times["plain"]), min(times["verify"])
            result.rows.append([f"{name}: {label}", f"{best_plain:.2f} s", f"{best_verify:.2f} s",
                                f"{best_verify / best_plain:.2f}", f"{min(ratios):.2f}–{max(ratios):.2f}"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
