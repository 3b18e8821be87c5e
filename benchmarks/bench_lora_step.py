"""A LoRA training step against a full fine-tuning step and against PEFT on transformers' class.

One process, a ~100M-parameter Llama (fp32, saved once under the benchmarks' directory), batch 2 × 256
tokens, AdamW; LoRA r=16 on all linear layers. Each case runs in a fresh process so its peak RSS is
its own. Reports the median step time of 6 steps after a warm-up, the RSS after loading, and the
peak RSS. Run: ``python -m benchmarks.bench_lora_step``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.bench_from_pretrained import CHECKPOINT
from benchmarks.bench_training_step import llama_100m_config
from benchmarks.common import Table, measure_main, run_measure, status_mib

BATCH, SEQUENCE, WARMUP, STEPS = 2, 256, 1, 6
MODULE = "benchmarks.bench_lora_step"
CHECKPOINT_100M = CHECKPOINT.parent / "llama-100m-fp32"
CASES = {"full": "full fine-tuning (ours)", "lora": "LoRA (ours, fused class)", "peft": "PEFT over transformers' class"}


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


def measure(kind: str) -> dict[str, Any]:
    return measure_steps(_model(kind, str(CHECKPOINT_100M)))


def _plain_step(model: Any, optimizer: Any, tokens: Any) -> None:
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_steps(model: Any, step: Callable[[Any, Any, Any], None] = _plain_step) -> dict[str, Any]:
    """AdamW over ``model``'s trainable parameters, the same batch every step: the median of the
    steps after the warm-up, the RSS once loaded, the peak RSS and the trainable count. ``step(model,
    optimizer, tokens)`` is one step (default: forward, backward, update)."""
    import torch

    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    loaded_mib = status_mib("VmRSS")
    tokens = torch.randint(0, 32000, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    times = []
    for number in range(WARMUP + STEPS):
        started = time.perf_counter()
        step(model, optimizer, tokens)
        if number >= WARMUP:
            times.append(time.perf_counter() - started)
    return {
        "seconds": statistics.median(times),
        "loaded_mib": loaded_mib,
        "peak_mib": status_mib("VmHWM"),
        "trainable": sum(p.numel() for p in trainable),
    }


def make_checkpoint_100m() -> None:
    """The 100M Llama (random fp32 weights) the step benchmarks train, written once."""
    if not (CHECKPOINT_100M / "config.json").exists():
        from transformers import LlamaForCausalLM

        LlamaForCausalLM(llama_100m_config()).save_pretrained(CHECKPOINT_100M)


def table() -> Table:
    make_checkpoint_100m()
    result = Table(
        f"training step, 100M Llama fp32, one process, {BATCH} × {SEQUENCE} tokens, AdamW, LoRA r=16 all-linear",
        ["step", "RSS after loading", "peak RSS", "trainable parameters"],
        note=f"Median of {STEPS} steps after {WARMUP} warm-up, each case in a fresh process.",
    )
    for kind, label in CASES.items():
        row = run_measure(MODULE, kind)[0]
        result.rows.append([label, f"{row['seconds']:.2f} s", f"{row['loaded_mib']:.0f} MiB",
                            f"{row['peak_mib']:.0f} MiB", f"{row['trainable'] / 1e6:.1f} M"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)
