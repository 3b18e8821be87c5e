"""``from_pretrained`` of a ~1.1B-parameter bf16 Llama (3 safetensors shards) against the floor.

Measured, each in a fresh process with a warm page cache and the default thread count, timing the
call alone (imports excluded) and touching every weight once afterwards:
- floor: read and copy every tensor's bytes into preallocated tensors (``readinto``);
- transformers' ``AutoModelForCausalLM.from_pretrained`` in one process;
- ``NeMoAutoModelForCausalLM.from_pretrained`` in one process, and under fsdp2 on 2 ranks.
Peak RSS is VmHWM minus the VmHWM after imports. Targets: one process ≤ 1.3× the floor; per-rank
peak on 2 ranks ≤ 0.6× the model's bytes. Run: ``python benchmarks/bench_from_pretrained.py``.
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

import torch

CHECKPOINT = Path(os.environ.get("NEMO_WRAP_BENCH_DIR", "/tmp/nemo_wrap_bench")) / "llama-1.1b-bf16"


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _make_checkpoint() -> None:
    """Random bf16 weights in transformers' key layout, written once, split into 3 shards."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if (CHECKPOINT / "model.safetensors.index.json").exists():
        return
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    CHECKPOINT.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(CHECKPOINT)
    generator = torch.Generator().manual_seed(0)
    keys = list(shapes)
    groups = [keys[i::3] for i in range(3)]
    weight_map = {}
    for number, group in enumerate(groups, 1):
        name = f"model-{number:05d}-of-00003.safetensors"
        tensors = {k: (torch.randn(shapes[k], generator=generator) * 0.02).to(torch.bfloat16) for k in group}
        save_file(tensors, CHECKPOINT / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
    (CHECKPOINT / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _touch_tensor(tensor) -> int:
    """Read one byte of every 4 KiB page: every page is faulted in (mmap-backed loads pay here)."""
    if tensor.numel() == 0:
        return 0
    return int(tensor.detach().reshape(-1).view(torch.uint8)[::4096].sum())


def _touch(model) -> int:
    return sum(_touch_tensor(p.to_local() if hasattr(p, "to_local") else p) for p in model.parameters())


def _measure(kind: str, output: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.checkpoint.locate import open_checkpoint
    from nemo_wrap.checkpoint.safetensors_file import BlockReader

    from transformers import LlamaForCausalLM  # noqa: F401 - import the modeling code before timing

    setup = None
    if kind == "nemo-fsdp2-2ranks":
        env = initialize_distributed()
        setup = DistributedSetup.build("fsdp2", env.world_size)
    baseline = _vm_hwm_mib()
    started = time.perf_counter()
    if kind == "floor":
        checkpoint = open_checkpoint(CHECKPOINT)
        with BlockReader() as reader:
            tensors = []
            for entry in checkpoint.entries.values():
                out = torch.empty(entry.shape, dtype=entry.dtype)
                reader.read_block_into(entry, tuple(slice(0, n) for n in entry.shape), out)
                tensors.append(out)
        sum(_touch_tensor(t) for t in tensors)
        model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    elif kind == "transformers":
        model = AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.bfloat16)
        _touch(model)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        model = NeMoAutoModelForCausalLM.from_pretrained(CHECKPOINT, distributed_setup=setup)
        _touch(model)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = time.perf_counter() - started
    rank = int(os.environ.get("RANK", 0))
    (output / f"{kind}-{rank}.json").write_text(json.dumps(
        dict(kind=kind, rank=rank, seconds=seconds, peak_mib=_vm_hwm_mib() - baseline, model_mib=model_bytes / 2**20)
    ))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure, args.output)
        return
    _make_checkpoint()
    me = [sys.executable, __file__]
    best: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for kind in ("floor", "transformers", "nemo-1process"):
                subprocess.run([*me, "--measure", kind, "--output", tmp], check=True)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            __file__, "--measure", "nemo-fsdp2-2ranks", "--output", tmp], check=True)
            for path in Path(tmp).glob("*.json"):
                row = json.loads(path.read_text())
                key = (row["kind"], row["rank"])
                if key not in best or row["seconds"] < best[key]["seconds"]:
                    best[key] = row
    floor = best[("floor", 0)]["seconds"]
    model_mib = best[("floor", 0)]["model_mib"]
    print(f"model: {model_mib:.0f} MiB of bf16 weights; best of {args.repeats}")
    print(f"{'load':<20}{'rank':>5}{'seconds':>9}{'× floor':>9}{'peak MiB':>10}{'peak/model':>12}")
    for (kind, rank), row in sorted(best.items(), key=lambda item: (item[0][0] != "floor", item[0])):
        print(f"{kind:<20}{rank:>5}{row['seconds']:>9.2f}{row['seconds'] / floor:>9.2f}"
              f"{row['peak_mib']:>10.0f}{row['peak_mib'] / model_mib:>12.2f}")


if __name__ == "__main__":
    main()
