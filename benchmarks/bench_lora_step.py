"""A LoRA training step against a full fine-tuning step and against PEFT on transformers' class.

One process, a ~100M-parameter Llama (fp32, saved once to a temporary checkpoint), batch 2 × 256
tokens, AdamW; LoRA r=16 on all linear layers. Each case runs in a fresh process so its peak RSS is
its own. Reports the median step time of 6 steps after a warm-up, the RSS after loading, and the
peak RSS. Run: ``python benchmarks/bench_lora_step.py``.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_training_step import llama_100m_config  # the same 100M Llama (run from benchmarks/)

BATCH, SEQUENCE, WARMUP, STEPS = 2, 256, 1, 6
CASES = ("full", "lora", "peft")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")


def _model(kind: str, checkpoint: str):
    if kind == "peft":
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        return get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), _lora_config())
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    extra = {"peft_config": _lora_config()} if kind == "lora" else {}
    return NeMoAutoModelForCausalLM.from_pretrained(checkpoint, **extra)


def _measure(kind: str, checkpoint: str) -> dict[str, float]:
    import torch

    model = _model(kind, checkpoint)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    loaded_mb = _rss_mb()
    tokens = torch.randint(0, 32000, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    times = []
    for step in range(WARMUP + STEPS):
        started = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    return {
        "step_s": statistics.median(times),
        "loaded_mb": loaded_mb,
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable": sum(p.numel() for p in trainable),
    }


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(_measure(sys.argv[1], sys.argv[2])))
        return
    with tempfile.TemporaryDirectory() as directory:
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(llama_100m_config()).save_pretrained(directory)
        results = {}
        for kind in CASES:
            run = subprocess.run([sys.executable, __file__, kind, directory], capture_output=True, text=True, check=True)
            results[kind] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{'case':6} {'step s':>8} {'RSS loaded MB':>14} {'peak RSS MB':>12} {'trainable':>12}")
    for kind, r in results.items():
        print(f"{kind:6} {r['step_s']:8.2f} {r['loaded_mb']:14.0f} {r['peak_mb']:12.0f} {r['trainable']:12,}")


if __name__ == "__main__":
    main()
