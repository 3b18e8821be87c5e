"""``from_pretrained`` of a ~1.1B-parameter bf16 Llama (3 safetensors shards) against the floor.

Each case runs in a fresh process with a warm page cache and the default thread count; the time
is the call alone (imports excluded) plus touching every page of the weights once, and the peak
is VmHWM above the VmHWM after imports:
- floor: ``safetensors.torch.load_file`` + ``clone()`` of every tensor (one copy out of the page cache);
- transformers' ``AutoModelForCausalLM.from_pretrained``, whose parameters stay a copy-on-write
  mapping of the files: also measured with a first write to every page, where it pays its copy;
- ours in one process, with ``verify=True``, into fp32 parameters, and under fsdp2 on 2 ranks.
Targets: ours ≤ 1.3× the floor; verify ≤ 1.5× the load; per rank on 2 ranks ≤ the one-process
time and ≤ 0.55× the model's bytes. Run: ``python -m benchmarks.bench_from_pretrained``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Table, best_of, measure_main, status_mib, touch

CHECKPOINT = Path(os.environ.get("NEMO_WRAP_BENCH_DIR", "/tmp/nemo_wrap_bench")) / "llama-1.1b-bf16"
MODULE = "benchmarks.bench_from_pretrained"
CASES = {
    "floor": "floor: `load_file` + `clone()`",
    "transformers": "transformers (pages mapped, not copied)",
    "transformers-written": "transformers + first write to every page",
    "nemo": "ours, one process",
    "nemo-verify": "ours, `verify=True`",
    "floor-fp32": "floor into fp32: `load_file` + `.float()`",
    "transformers-fp32": "transformers into fp32",
    "nemo-fp32": "ours into fp32 (converted while copying)",
    "nemo-fsdp2": "ours, fsdp2 on 2 ranks (per rank)",
}


def make_checkpoint() -> None:
    """Random bf16 weights in transformers' key layout, written once, split into 3 shards."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if (CHECKPOINT / "model.safetensors.index.json").exists():
        return
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    CHECKPOINT.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(CHECKPOINT)
    generator = torch.Generator().manual_seed(0)
    keys = list(shapes)
    weight_map = {}
    for number in range(3):
        name = f"model-{number + 1:05d}-of-00003.safetensors"
        group = keys[number::3]
        tensors = {k: (torch.randn(shapes[k], generator=generator) * 0.02).to(torch.bfloat16) for k in group}
        save_file(tensors, CHECKPOINT / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    (CHECKPOINT / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _load(kind: str) -> list[Any]:
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    files = sorted(CHECKPOINT.glob("*.safetensors"))
    if kind.startswith("floor"):
        convert = (lambda t: t.float()) if kind == "floor-fp32" else (lambda t: t.clone())
        return [convert(t) for f in files for t in safetensors.torch.load_file(f).values()]
    dtype = torch.float32 if kind.endswith("fp32") else torch.bfloat16
    if kind.startswith("transformers"):
        return list(AutoModelForCausalLM.from_pretrained(CHECKPOINT, dtype=dtype).parameters())
    setup = None
    if kind == "nemo-fsdp2":
        setup = DistributedSetup.build("fsdp2", initialize_distributed().world_size)
    model = NeMoAutoModelForCausalLM.from_pretrained(CHECKPOINT, setup, dtype=dtype, verify=kind == "nemo-verify")
    return list(model.parameters())


def measure(kind: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM  # noqa: F401 - the modeling code is imported before timing

    import nemo_wrap.auto  # noqa: F401

    if kind == "nemo-fsdp2":  # the process group is joined before timing, as for every other import
        from nemo_wrap import initialize_distributed

        initialize_distributed()
    baseline = status_mib("VmHWM")
    started = time.perf_counter()
    tensors = _load(kind)
    touch(tensors)
    if kind == "transformers-written":
        with torch.no_grad():
            for tensor in tensors:
                tensor.reshape(-1).view(torch.uint8)[::4096].add_(0)
    seconds = time.perf_counter() - started
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return {"seconds": seconds, "peak_mib": status_mib("VmHWM") - baseline,
            "local_mib": sum(t.numel() * t.element_size() for t in local) / 2**20}  # fmt: skip


def table(repeats: int = 3) -> Table:
    make_checkpoint()
    best = best_of(repeats, MODULE, list(CASES), nproc={"nemo-fsdp2": 2})
    model_mib = best["floor"][0]["local_mib"]
    seconds = {kind: max(r["seconds"] for r in rows) for kind, rows in best.items()}
    result = Table(
        f"`from_pretrained`, 1.1B Llama, bf16, 3 shards ({model_mib:.0f} MiB)",
        ["time", "× floor", "peak RSS above imports", "peak / model bytes"],
        note=f"Best of {repeats} fresh processes, every page of the weights touched after loading; "
        f"fp32 rows compare with the fp32 floor. `verify=True` takes {seconds['nemo-verify'] / seconds['nemo']:.2f}× "
        f"the load without it; a rank on 2 takes {seconds['nemo-fsdp2'] / seconds['nemo']:.2f}× the one-process load.",
    )
    for kind, label in CASES.items():
        row = max(best[kind], key=lambda r: r["seconds"])
        floor = seconds["floor-fp32" if kind.endswith("fp32") else "floor"]
        size = model_mib * (2 if kind.endswith("fp32") else 1)
        result.rows.append([label, f"{row['seconds']:.2f} s", f"{row['seconds'] / floor:.2f}",
                            f"{row['peak_mib']:.0f} MiB", f"{row['peak_mib'] / size:.2f}"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
