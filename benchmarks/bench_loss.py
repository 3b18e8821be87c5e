"""The loss without the full logits: a training step's tensor peak and time, full path vs chunked.

SmolLM2-135M's shape (hidden 576, vocabulary 49,152, tied embeddings) with 2 decoder layers, so
the loss weighs as it does in the real model's step while the step stays short on a CPU; fp32,
AdamW, one row. Side by side in one run: our full path (``LoadOptions(loss="full")``:
transformers' loss on the whole logits), our chunked path (the default), TRL's fused LM head
(``add_fused_lm_head``, what its ``SFTTrainer`` uses; transformers' model, one process only) and
the backbone alone (the head on the last position only: what every path needs besides the loss).
Memory is tensor bytes at the step's peak from torch's ``MemTracker``; the loss's extra is that
peak minus the backbone's. Run: ``python -m benchmarks.bench_loss``.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Table, measure_main, run_measure

MODULE = "benchmarks.bench_loss"
VOCAB, STEPS = 49152, 3
OURS, WITH_TRL = ("full", "chunked", "backbone"), ("full", "chunked", "trl", "backbone")
# (layout, tokens, ranks, paths); TRL's fused head only up to 4k tokens: at 8k it needs ~10 GiB
CASES = [("one", 2048, 1, WITH_TRL), ("one", 4096, 1, WITH_TRL), ("one", 8192, 1, OURS)]
CASES += [(layout, tokens, 2, OURS) for layout in ("fsdp2", "tp2") for tokens in (4096, 8192)]


def smollm2_shape(heads: int = 9, kv_heads: int = 3) -> Any:
    """SmolLM2-135M with 2 layers; tensor parallel over 2 ranks takes 8 heads and 2 kv heads (its
    9 and 3 do not split in two), which leaves the head and the loss as they are."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=True,
    )


def measure(kind: str) -> dict[str, Any]:
    """``kind``: ``PATH:TOKENS:LAYOUT``; the step's best time and tensor peak on this rank."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    path, tokens, layout = kind.split(":")
    model, step = _model_and_step(path, layout)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, VOCAB, (1, int(tokens)), generator=torch.Generator().manual_seed(0))
    step(model, optimizer, ids)  # the optimizer state exists from here on
    times = []
    for _ in range(STEPS):
        started = time.perf_counter()
        step(model, optimizer, ids)
        times.append(time.perf_counter() - started)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step(model, optimizer, ids)
    peak = tracker.get_tracker_snapshot("peak")
    return {"seconds": min(times), "peak_mib": max(device["Total"] for device in peak.values()) / 2**20}


def _model_and_step(path: str, layout: str) -> tuple[Any, Any]:
    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.loading.options import LoadOptions

    if path == "trl":
        return _trl_model(), _trl_step
    setup = DistributedSetup.single_process()
    if layout != "one":
        env = initialize_distributed()
        setup = DistributedSetup.build("fsdp2", env.world_size, tp_size=2 if layout == "tp2" else 1)
    options = LoadOptions(seed=0, dtype="float32", loss="full" if path == "backbone" else path)
    config = smollm2_shape(8, 2) if layout == "tp2" else smollm2_shape()
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, options=options)
    return model, _backbone_step if path == "backbone" else _our_step


def _our_step(model: Any, optimizer: Any, ids: Any) -> None:
    from nemo_wrap.training import train_step

    train_step(model, optimizer, [{"input_ids": ids}])


def _backbone_step(model: Any, optimizer: Any, ids: Any) -> None:
    """The model's forward and backward with its head on the last position only (the strategies'
    hooks run as in any step): what every loss path needs besides the loss."""
    model(input_ids=ids, logits_to_keep=1).logits.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _trl_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(smollm2_shape(), dtype=torch.float32)
    add_fused_lm_head(model)
    return model


def _trl_step(model: Any, optimizer: Any, ids: Any) -> None:
    output = model(input_ids=ids, labels=ids, fused_lm_head=True)
    (-output.log_probs.sum() / (ids.numel() - 1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def table() -> Table:
    rows = []
    for layout, tokens, nproc, paths in CASES:
        measured = {path: run_measure(MODULE, f"{path}:{tokens}:{layout}", nproc) for path in paths}
        peak = {path: max(r["peak_mib"] for r in runs) for path, runs in measured.items()}
        seconds = {path: max(r["seconds"] for r in runs) for path, runs in measured.items()}
        extra = {path: peak[path] - peak["backbone"] for path in peak}
        for path in paths[:-1]:
            rows.append(
                [
                    f"{layout}, {tokens} tokens",
                    path,
                    f"{peak[path]:.0f} MiB",
                    f"{extra[path]:.0f} MiB",
                    f"{extra[path] / peak[path]:.0%}",
                    f"{extra[path] / extra['full']:.2f}",
                    f"{seconds[path]:.2f} s",
                    f"{seconds['full'] / seconds[path]:.2f}×",
                ]
            )
    return Table(
        "the loss, SmolLM2's shape (vocabulary 49,152, hidden 576, 2 layers), fp32, AdamW, one row",
        ["path", "step tensor peak", "loss's extra", "its share of the peak", "÷ full's", "step", "speed vs full"],
        rows,
        note=(
            "Peak: torch's MemTracker, the worst rank; the loss's extra: that peak minus the backbone's alone "
            f"(the head on the last position only). Step: best of {STEPS} after a warm-up step. "
            "fsdp2 and tp2: 2 ranks, the row's tokens on each."
        ),
    )


if __name__ == "__main__":
    measure_main(measure, table)
