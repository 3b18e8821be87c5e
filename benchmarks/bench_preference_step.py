"""A preference step (DPO, SimPO) against the SFT step on the same pairs: step time and tensor peak.

SmolLM2-135M's shape with 2 decoder layers (``bench_loss``'s: vocabulary 49,152, so the loss weighs
as in the real model), fp32, AdamW, one micro-batch of 2 pairs per rank: 4 sequences of 256 tokens
(a 64-token prompt shared by each pair, then 192 completion tokens; labels -100 on the prompt), as
``pair_rows`` lays them out. The SFT step is ``train_step`` on the same 4 sequences and labels, so
the tokens are equal and the difference is the objective plus the reference's forward. The cases:
DPO full fine-tuning (the reference a frozen copy, loaded and sharded like the model: its
parameters are in the peak), DPO with LoRA r=16 on all linear layers (the reference the same model
with its adapters off) against an SFT step of that LoRA model, SimPO (no reference). Every step
takes the default chunked path (log-probabilities a chunk of pairs at a time, never the
``[tokens, vocabulary]`` logits). Memory: tensor bytes at the peak of a step (torch's
``MemTracker``, ``nemo_wrap.memory.tracking.second_step_peak``), per rank. Time: each case's step
and the SFT step of the same model timed alternately in one job, so the machine's background load
weighs on both alike. One process and fsdp2 on 2 ranks. Run: ``python -m benchmarks.bench_preference_step``.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.bench_loss import VOCAB, smollm2_shape
from benchmarks.common import Table, measure_main, run_measure

MODULE = "benchmarks.bench_preference_step"
PAIRS, PROMPT, COMPLETION, STEPS = 2, 64, 192, 3
# case: (label, objective or None for SFT, LoRA, the SFT case it is compared with)
CASES = {
    "sft": ("SFT (`train_step`)", None, False, "sft"),
    "dpo": ("DPO, reference a frozen copy", "dpo", False, "sft"),
    "simpo": ("SimPO, no reference", "simpo", False, "sft"),
    "sft-lora": ("SFT, LoRA", None, True, "sft-lora"),
    "dpo-lora": ("DPO, LoRA, reference its adapters off", "dpo", True, "sft-lora"),
}
LAYOUTS = {"one": 1, "fsdp2": 2}
KINDS = ("Parameter", "Gradient", "Optstate", "Activation", "Temp")
BREAKDOWN = "at the peak: parameters / gradients / optimizer / activations / temporaries (MiB)"


def pairs_batch(rank: int) -> dict[str, Any]:
    """One micro-batch of ``PAIRS`` synthetic pairs (rows ``2i`` chosen, ``2i + 1`` rejected, sharing
    a prompt), as ``pair_rows`` lays them out; each rank its own tokens."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    prompts = torch.randint(0, VOCAB, (PAIRS, PROMPT), generator=generator).repeat_interleave(2, dim=0)
    completions = torch.randint(0, VOCAB, (2 * PAIRS, COMPLETION), generator=generator)
    input_ids = torch.cat([prompts, completions], dim=1)
    labels = input_ids.clone()
    labels[:, :PROMPT] = -100
    position_ids = torch.arange(PROMPT + COMPLETION).expand(2 * PAIRS, -1).contiguous()
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _load(layout: str, lora: bool) -> Any:
    from peft import LoraConfig

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.loading.options import LoadOptions

    setup = DistributedSetup.single_process()
    if layout != "one":
        setup = DistributedSetup.build(layout, initialize_distributed().world_size)
    peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if lora else None
    options = LoadOptions(seed=0, dtype="float32", peft_config=peft)
    return NeMoAutoModelForCausalLM.from_config(smollm2_shape(), distributed_setup=setup, options=options)


def measure(kind: str) -> dict[str, Any]:
    """``kind``: ``CASE:LAYOUT``; the step's tensor peak by kind on this rank, then this rank's best
    time of the case's step and of the SFT step on the same model, timed alternately (so that the
    machine's background load weighs on both alike)."""
    import os

    import torch

    from nemo_wrap.memory.tracking import second_step_peak
    from nemo_wrap.training import freeze_teacher, train_step
    from nemo_wrap.training.preference import preference_step, reference_for
    from nemo_wrap.training.preference_loss import PreferenceObjective, PreferenceSettings

    case, layout = kind.split(":")
    _, objective, lora, _ = CASES[case]
    model = _load(layout, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batches = [pairs_batch(int(os.environ.get("RANK", 0)))]

    def sft(micro_batches: Any) -> object:
        return train_step(model, optimizer, micro_batches)

    step, tracked = sft, model
    if objective is not None:
        beta = 0.1 if objective == "dpo" else 2.0  # TRL's DPO default; SimPO's paper and TRL's CPOConfig
        settings = PreferenceSettings(PreferenceObjective(objective), beta=beta)
        copy = freeze_teacher(_load(layout, lora)) if objective == "dpo" and not lora else None
        reference = reference_for(model, settings, copy)
        if copy is not None:  # the tracker counts the copy's parameters from the start
            tracked = torch.nn.ModuleList([model, copy])

        def step(micro_batches: Any) -> object:
            return preference_step(model, optimizer, micro_batches, settings, reference)

    peak = second_step_peak(tracked, optimizer, batches, step)  # a warm-up step, then the tracked one
    steps = {"seconds": step} if step is sft else {"seconds": step, "sft_seconds": sft}
    if step is not sft:
        sft(batches)  # its warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(STEPS):
        for name, run in steps.items():
            started = time.perf_counter()
            run(batches)
            times[name].append(time.perf_counter() - started)
    best = {name: min(seconds) for name, seconds in times.items()}
    return {"sft_seconds": best["seconds"], **best, "peak": peak}


def table() -> Table:
    rows = []
    for layout, nproc in LAYOUTS.items():
        measured = {case: run_measure(MODULE, f"{case}:{layout}", nproc) for case in CASES}
        seconds = {case: max(r["seconds"] for r in runs) for case, runs in measured.items()}
        alongside = {case: max(r["sft_seconds"] for r in runs) for case, runs in measured.items()}
        peak = {case: max(r["peak"]["Total"] for r in runs) for case, runs in measured.items()}
        for case, (label, _, _, baseline) in CASES.items():
            worst = max(measured[case], key=lambda r: r["peak"]["Total"])["peak"]
            rows.append(
                [
                    "one process" if nproc == 1 else f"{layout}, {nproc} ranks",
                    label,
                    f"{seconds[case]:.2f} s",
                    f"{seconds[case] / alongside[case]:.2f}×",
                    " / ".join(f"{r['peak']['Total'] / 2**20:.0f}" for r in measured[case]) + " MiB",
                    f"{peak[case] / peak[baseline]:.2f}×",
                    " / ".join(f"{worst.get(name, 0) / 2**20:.0f}" for name in KINDS),
                ]
            )
    return Table(
        f"preference step vs SFT on the same pairs, SmolLM2's shape (vocabulary {VOCAB:,}, hidden 576, 2 layers), "
        f"fp32, AdamW, {PAIRS} pairs × 2 × {PROMPT + COMPLETION} tokens per rank",
        ["step", "step time", "vs SFT", "tensor peak per rank", "vs SFT", BREAKDOWN],
        rows,
        note=(
            f"Each pair: a {PROMPT}-token prompt, then {COMPLETION} completion tokens each side (labels -100 on the "
            f"prompt). SFT: `train_step` on the same {2 * PAIRS} sequences and labels (chosen and rejected), so the "
            "tokens are equal and the difference is the objective plus the reference's forward; the LoRA rows "
            "(r=16, all linear layers) are compared with the SFT step of the LoRA model. DPO's frozen copy is "
            "loaded and sharded like the model, its parameters counted in the peak. Every step takes the default "
            "chunked path: log-probabilities a chunk of pairs at a time, never the [tokens, vocabulary] logits. "
            f"Step time: the slowest rank's best of {STEPS} after a warm-up; its ratio is to the SFT step of the same "
            "model timed alternately with it in the same job (so that the 2 shared cores' background load weighs on "
            "both alike). Peak: torch's MemTracker over a step (`second_step_peak`), each rank; the breakdown is the "
            "worst rank's at its peak."
        ),
    )


if __name__ == "__main__":
    measure_main(measure, table)
