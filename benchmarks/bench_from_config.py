"""Time and peak memory of building a ~1.1B-parameter Llama from a config.

Compares transformers' ``AutoModelForCausalLM.from_config`` in one process with
``NeMoAutoModelForCausalLM.from_config`` in one process and under fsdp2 on 2 ranks (torchrun).
Each measurement runs in a fresh process; peak memory is VmHWM minus the VmHWM reached after
imports, so the numbers are the build's own. Run: ``python -m benchmarks.bench_from_config``.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Table, measure_main, run_measure, status_mib

MODULE = "benchmarks.bench_from_config"
LABELS = {"hf": "transformers, one process", "nemo": "ours, one process", "nemo-fsdp2": "ours, fsdp2 on 2 ranks"}


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip


def measure(kind: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    setup = DistributedSetup.build("fsdp2", initialize_distributed().world_size) if kind == "nemo-fsdp2" else None
    baseline = status_mib("VmHWM")
    started = time.perf_counter()
    if kind == "hf":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config())
    else:
        model = NeMoAutoModelForCausalLM.from_config(_config(), distributed_setup=setup, seed=0)
    seconds = time.perf_counter() - started
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {"seconds": seconds, "peak_mib": status_mib("VmHWM") - baseline,
            "local_mib": sum(p.numel() * p.element_size() for p in local) / 2**20}  # fmt: skip


def table() -> Table:
    result = Table("`from_config`, 1.1B Llama, fp32", ["time", "peak RSS", "parameters held"],
                   note="Fresh processes; on 2 ranks, the slower rank.")  # fmt: skip
    for kind, label in LABELS.items():
        rows = run_measure(MODULE, kind, nproc=2 if kind == "nemo-fsdp2" else 1)
        worst = {key: max(row[key] for row in rows) for key in ("seconds", "peak_mib", "local_mib")}
        per_rank = " per rank" if kind == "nemo-fsdp2" else ""
        result.rows.append([label, f"{worst['seconds']:.1f} s{per_rank}", f"{worst['peak_mib']:.0f} MiB",
                            f"{worst['local_mib']:.0f} MiB"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
