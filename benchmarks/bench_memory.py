"""The memory prediction against measurement: each rank's predicted tensor peak in a training step
(``predict_memory``, a dry run on fake tensors) beside the peak torch's ``MemTracker`` measures in
the same step run for real (fresh torchrun jobs on gloo ranks, the second of two steps).

Models: a 30M-class Llama (4 layers, hidden 512, vocabulary 8,192), untied, tied and with LoRA
adapters, and a Qwen3-MoE of the same dimensions (8 experts, 2 a token). Layouts: one process, ddp,
fsdp2, tp, fsdp × tp, HSDP, cp and cp × fsdp; 256 to 8,192 tokens a row; activation checkpointing
on and off. Goal: every rank within ±10%.
Run: ``python -m benchmarks.bench_memory``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.common import Table, measure_main, run_measure

MODULE = "benchmarks.bench_memory"


@dataclass(frozen=True)
class Case:
    """One configuration: the model, the layout and the step's shape."""

    model: str  # untied | tied | moe | lora (the untied Llama with LoRA adapters)
    layout: str  # one | ddp | fsdp2 | tp | fsdp_tp | hsdp | cp | cp_dp
    rows: int
    tokens: int
    recompute: bool = False

    @property
    def ranks(self) -> int:
        return {"one": 1, "fsdp_tp": 4, "hsdp": 4, "cp_dp": 4}.get(self.layout, 2)

    def label(self) -> str:
        recomputed = ", recomputed" if self.recompute else ""
        return f"{self.model}, {self.layout} × {self.ranks}, {self.rows} × {self.tokens} tokens{recomputed}"


CASES = {
    f"case{number}": case
    for number, case in enumerate(
        [
            Case("untied", "one", 4, 256),
            Case("tied", "one", 4, 1024),
            Case("untied", "one", 2, 4096, recompute=True),
            Case("tied", "one", 1, 8192, recompute=True),
            Case("untied", "ddp", 4, 256),
            Case("tied", "ddp", 4, 1024),
            Case("untied", "ddp", 4, 1024, recompute=True),
            Case("untied", "fsdp2", 4, 256),
            Case("tied", "fsdp2", 4, 256),
            Case("untied", "fsdp2", 4, 1024),
            Case("tied", "fsdp2", 1, 4096),
            Case("untied", "fsdp2", 4, 1024, recompute=True),
            Case("untied", "fsdp2", 1, 8192, recompute=True),
            Case("tied", "fsdp2", 2, 2048),
            Case("untied", "tp", 4, 256),
            Case("tied", "tp", 4, 1024),
            Case("untied", "tp", 4, 1024, recompute=True),
            Case("untied", "tp", 1, 4096),
            Case("untied", "fsdp_tp", 4, 256),
            Case("tied", "fsdp_tp", 4, 1024),
            Case("untied", "fsdp_tp", 4, 1024, recompute=True),
            Case("untied", "hsdp", 4, 256),
            Case("tied", "hsdp", 4, 1024),
            Case("untied", "hsdp", 4, 1024, recompute=True),
            Case("untied", "cp", 2, 2048),
            Case("tied", "cp_dp", 2, 1024),
            Case("moe", "one", 4, 512),
            Case("moe", "fsdp2", 4, 1024),
            Case("moe", "fsdp2", 2, 2048, recompute=True),
            Case("moe", "tp", 4, 512),
            Case("moe", "fsdp_tp", 2, 1024),
            Case("lora", "one", 4, 1024),
            Case("lora", "ddp", 4, 512),
            Case("lora", "fsdp2", 4, 1024),
            Case("lora", "fsdp2", 2, 4096, recompute=True),
            Case("lora", "fsdp_tp", 4, 512),
        ],
        1,
    )
}


def llama_30m(tied: bool) -> Any:
    """The 30M-class Llama of the memory benchmarks (``bench_auto_layout`` too)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=tied,
    )


def moe_30m() -> Any:
    """A Qwen3-MoE of the 30M Llama's dimensions: 8 experts of width 512, 2 a token."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        moe_intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )


def _config(case: Case) -> Any:
    return moe_30m() if case.model == "moe" else llama_30m(case.model == "tied")


def load_options(lora: bool) -> Any:
    """The load options of the memory benchmarks (``bench_auto_layout`` too): LoRA r 16 on every linear layer."""
    from peft import LoraConfig

    from nemo_wrap.loading.options import LoadOptions

    return LoadOptions(seed=0, peft_config=LoraConfig(r=16, target_modules="all-linear") if lora else None)


def _options(case: Case) -> Any:
    return load_options(case.model == "lora")


def _setup(case: Case) -> Any:
    from nemo_wrap import DistributedSetup

    builds = {
        "one": lambda: DistributedSetup.single_process(),
        "ddp": lambda: DistributedSetup.build("ddp", 2),
        "fsdp2": lambda: DistributedSetup.build("fsdp2", 2),
        "tp": lambda: DistributedSetup.build("fsdp2", 2, tp_size=2),
        "fsdp_tp": lambda: DistributedSetup.build("fsdp2", 4, tp_size=2),
        "hsdp": lambda: DistributedSetup.build("fsdp2", 4, dp_replicate_size=2),
        "cp": lambda: DistributedSetup.build("fsdp2", 2, cp_size=2),
        "cp_dp": lambda: DistributedSetup.build("fsdp2", 4, cp_size=2),
    }
    return builds[case.layout]()


def _shape(case: Case) -> Any:
    from nemo_wrap.memory import TrainingShape

    return TrainingShape(case.rows, case.tokens, activation_checkpointing=case.recompute)


def measure(kind: str) -> dict[str, Any]:
    """This rank's tensor peak (MemTracker) in the second of two real steps of case ``kind``."""
    import torch

    from nemo_wrap import initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.memory.tracking import second_step_peak
    from nemo_wrap.training import train_step

    case = CASES[kind]
    if case.ranks > 1:
        initialize_distributed()
    model = NeMoAutoModelForCausalLM.from_config(_config(case), _setup(case), options=_options(case))
    if case.recompute:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = torch.randint(0, 8192, (case.rows, case.tokens), generator=torch.Generator().manual_seed(0))
    peak = second_step_peak(
        model, optimizer, [{"input_ids": rows}], lambda batches: train_step(model, optimizer, batches)
    )
    return {"peak": peak["Total"]}


def table() -> Table:
    from nemo_wrap.memory import predict_memory

    result = Table(
        "Predicted vs measured tensor peak per rank",
        ["predicted (MiB, per rank)", "measured (MiB, per rank)", "predicted / measured, per rank"],
    )
    worst = 0.0
    for kind, case in CASES.items():
        predicted = [
            rank.peak_bytes
            for rank in predict_memory(_config(case), _setup(case), _shape(case), _options(case)).per_rank
        ]
        measured = [row["peak"] for row in run_measure(MODULE, kind, case.ranks)]
        ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
        worst = max(worst, *(abs(r - 1) for r in ratios))
        result.rows.append([case.label(), _cells(predicted), _cells(measured), " ".join(f"{r:.3f}" for r in ratios)])
    result.note = (
        f"Measured: torch's MemTracker over the second of two real training steps (fresh torchrun jobs, gloo); "
        f"predicted: `predict_memory`, a dry run of the same load and step on fake tensors and a fake process "
        f"group. Worst rank off by {worst:.1%} (goal: ±10%)."
    )
    return result


def _cells(values: list[float]) -> str:
    return " / ".join(f"{value / 2**20:.1f}" for value in values)


if __name__ == "__main__":
    measure_main(measure, table)
