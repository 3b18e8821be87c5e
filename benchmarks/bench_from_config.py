"""Time and peak memory of building a ~1.1B-parameter Llama from a config.

Compares transformers' ``AutoModelForCausalLM.from_config`` in one process with
``NeMoAutoModelForCausalLM.from_config`` in one process and under fsdp2 on 2 ranks (torchrun).
Each measurement runs in a fresh process; peak memory is VmHWM minus the VmHWM reached after
imports, so the numbers are the build's own. Run: ``python benchmarks/bench_from_config.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype="float32",
    )


def _measure(kind: str, output: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    config = _config()
    setup = None
    if kind == "nemo-fsdp2":
        env = initialize_distributed()
        setup = DistributedSetup.build("fsdp2", env.world_size)
    baseline = _vm_hwm_mib()
    started = time.perf_counter()
    if kind == "hf":
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, seed=0)
    seconds = time.perf_counter() - started
    local_bytes = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters()
    )
    rank = int(os.environ.get("RANK", 0))
    result = dict(kind=kind, rank=rank, seconds=seconds, peak_mib=_vm_hwm_mib() - baseline,
                  local_param_mib=local_bytes / 2**20, params=sum(p.numel() for p in model.parameters()))
    (output / f"{kind}-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure", choices=["hf", "nemo", "nemo-fsdp2"])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure, args.output)
        return
    with tempfile.TemporaryDirectory() as tmp:
        me = [sys.executable, __file__]
        subprocess.run([*me, "--measure", "hf", "--output", tmp], check=True)
        subprocess.run([*me, "--measure", "nemo", "--output", tmp], check=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        __file__, "--measure", "nemo-fsdp2", "--output", tmp], check=True)
        rows = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("*.json"))]
    print(f"{'build':<22}{'rank':>5}{'seconds':>10}{'peak MiB':>11}{'local params MiB':>18}")
    for row in rows:
        print(f"{row['kind']:<22}{row['rank']:>5}{row['seconds']:>10.2f}{row['peak_mib']:>11.0f}{row['local_param_mib']:>18.0f}")
    print(f"parameters: {rows[0]['params']:,}")


if __name__ == "__main__":
    main()
