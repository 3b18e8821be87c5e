"""The memory prediction against measurement: each rank's predicted tensor peak in a training step
(``predict_memory``, a dry run on fake tensors) beside the peak torch's ``MemTracker`` measures in
the same step run for real (fresh torchrun jobs on gloo ranks, the second of two steps).

Models: a 30M-class Llama (4 layers, hidden 512, vocabulary 8,192), untied, tied, with LoRA
adapters and with QLoRA's (4-bit NF4 layers, loaded from a saved checkpoint), and a Qwen3-MoE of the
same dimensions (8 experts, 2 a token). Layouts: one process, ddp, fsdp2, tp, fsdp × tp, HSDP, cp,
cp × fsdp, ep, ep × fsdp and ep × tp; 256 to 8,192 tokens a row; activation checkpointing on and
off. Goal: every rank within ±10%.
Run: ``python -m benchmarks.bench_memory``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Table, measure_main, run_measure

MODULE = "benchmarks.bench_memory"
# where the measuring jobs find the checkpoints the table saved (the 4-bit cases load one)
CHECKPOINTS_VARIABLE = "BENCH_MEMORY_CHECKPOINTS"


@dataclass(frozen=True)
class Case:
    """One configuration: the model, the layout and the step's shape."""

    model: str  # untied | tied | moe | lora (the untied Llama with LoRA adapters) | qlora (4-bit, with them)
    # one | ddp | fsdp2 | tp | fsdp_tp | hsdp | cp | cp_dp | ep | ep_dp | ep_tp | pp_gpipe | pp_1f1b | pp_dp
    layout: str
    rows: int
    tokens: int
    recompute: bool = False
    micro_batches: int = 1

    @property
    def ranks(self) -> int:
        four = ("fsdp_tp", "hsdp", "cp_dp", "ep_dp", "ep_tp", "pp_dp")
        return 1 if self.layout == "one" else 4 if self.layout in four else 2

    def label(self) -> str:
        recomputed = ", recomputed" if self.recompute else ""
        batches = f" × {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
        return f"{self.model}, {self.layout} × {self.ranks}, {self.rows} × {self.tokens} tokens{batches}{recomputed}"


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
            Case("moe", "ep", 4, 1024),
            Case("moe", "ep", 2, 2048, recompute=True),
            Case("moe", "ep_dp", 4, 512),
            Case("moe", "ep_tp", 2, 1024),
            Case("lora", "one", 4, 1024),
            Case("lora", "ddp", 4, 512),
            Case("lora", "fsdp2", 4, 1024),
            Case("lora", "fsdp2", 2, 4096, recompute=True),
            Case("lora", "fsdp_tp", 4, 512),
            Case("qlora", "one", 4, 1024),
            Case("qlora", "fsdp2", 4, 1024),
            Case("qlora", "fsdp2", 2, 4096, recompute=True),
            Case("untied", "pp_gpipe", 2, 512, micro_batches=4),
            Case("tied", "pp_gpipe", 1, 2048, recompute=True, micro_batches=2),
            Case("untied", "pp_1f1b", 2, 512, micro_batches=4),
            Case("tied", "pp_1f1b", 1, 2048, recompute=True, micro_batches=2),
            Case("untied", "pp_dp", 2, 1024, micro_batches=2),
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


def quantizable_llama_30m() -> Any:
    """The untied 30M Llama with a feed-forward width of 1,408, a multiple of 64, so that every linear
    layer can be held in 4 bits (bitsandbytes' blocks of 64 must not cross a row)."""
    config = llama_30m(tied=False)
    config.intermediate_size = 1408
    return config


def _config(case: Case) -> Any:
    if case.model == "qlora":
        return quantizable_llama_30m()
    return moe_30m() if case.model == "moe" else llama_30m(case.model == "tied")


def load_options(lora: bool, quantized: bool = False) -> Any:
    """The load options of the memory benchmarks (``bench_auto_layout`` too): LoRA r 16 on every
    linear layer; ``quantized``: QLoRA's, NF4 with double quantization, computed in bfloat16."""
    import torch
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from nemo_wrap.loading.options import LoadOptions

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return LoadOptions(
        seed=0,
        peft_config=LoraConfig(r=16, target_modules="all-linear") if lora or quantized else None,
        quantization_config=nf4 if quantized else None,
    )


def _options(case: Case) -> Any:
    return load_options(case.model == "lora", quantized=case.model == "qlora")


def _source(case: Case, checkpoints: Path) -> Any:
    """What the case loads: its config, or (4-bit layers are quantized while a checkpoint is read)
    a checkpoint of it saved under ``checkpoints`` by :func:`_saved_checkpoint`."""
    return checkpoints / case.model if case.model == "qlora" else _config(case)


def _saved_checkpoint(case: Case, checkpoints: Path) -> None:
    from transformers import AutoModelForCausalLM

    if case.model == "qlora" and not (checkpoints / case.model).exists():
        AutoModelForCausalLM.from_config(_config(case)).save_pretrained(checkpoints / case.model)


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
        "ep": lambda: DistributedSetup.build("fsdp2", 2, ep_size=2),
        "ep_dp": lambda: DistributedSetup.build("fsdp2", 4, ep_size=2),
        "ep_tp": lambda: DistributedSetup.build("fsdp2", 4, ep_size=2, tp_size=2),
        "pp_gpipe": lambda: DistributedSetup.build("fsdp2", 2, pp_size=2, pp_schedule="gpipe"),
        "pp_1f1b": lambda: DistributedSetup.build("fsdp2", 2, pp_size=2, pp_schedule="1f1b"),
        "pp_dp": lambda: DistributedSetup.build("fsdp2", 4, pp_size=2, pp_schedule="1f1b"),
    }
    return builds[case.layout]()


def _shape(case: Case) -> Any:
    from nemo_wrap.memory import TrainingShape

    return TrainingShape(case.rows, case.tokens, case.micro_batches, activation_checkpointing=case.recompute)


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
    source = _source(case, Path(os.environ[CHECKPOINTS_VARIABLE]))
    if isinstance(source, Path):
        model = NeMoAutoModelForCausalLM.from_pretrained(source, _setup(case), options=_options(case))
    else:
        model = NeMoAutoModelForCausalLM.from_config(source, _setup(case), options=_options(case))
    if case.recompute:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = torch.randint(0, 8192, (case.rows, case.tokens), generator=torch.Generator().manual_seed(0))
    peak = second_step_peak(
        model,
        optimizer,
        [{"input_ids": rows}] * case.micro_batches,
        lambda batches: train_step(model, optimizer, batches),
    )
    return {"peak": peak["Total"]}


def table() -> Table:
    result = Table(
        "Predicted vs measured tensor peak per rank",
        ["predicted (MiB, per rank)", "measured (MiB, per rank)", "predicted / measured, per rank"],
    )
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as folder:
        rows = [(case, *_predicted_and_measured(kind, case, Path(folder))) for kind, case in CASES.items()]
    for case, predicted, measured in rows:
        ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
        worst = max(worst, *(abs(r - 1) for r in ratios))
        result.rows.append([case.label(), _cells(predicted), _cells(measured), " ".join(f"{r:.3f}" for r in ratios)])
    result.note = (
        f"Measured: torch's MemTracker over the second of two real training steps (fresh torchrun jobs, gloo); "
        f"predicted: `predict_memory`, a dry run of the same load and step on fake tensors and a fake process "
        f"group. Worst rank off by {worst:.1%} (goal: ±10%)."
    )
    return result


def _predicted_and_measured(kind: str, case: Case, checkpoints: Path) -> tuple[list[int], list[int]]:
    """Each rank's predicted and measured peak of one case."""
    from nemo_wrap.memory import predict_memory

    _saved_checkpoint(case, checkpoints)
    source = _source(case, checkpoints)
    predicted = [
        rank.peak_bytes for rank in predict_memory(source, _setup(case), _shape(case), _options(case)).per_rank
    ]
    jobs = run_measure(MODULE, kind, case.ranks, env={CHECKPOINTS_VARIABLE: str(checkpoints)})
    return predicted, [row["peak"] for row in jobs]


def _cells(values: list[float]) -> str:
    return " / ".join(f"{value / 2**20:.1f}" for value in values)


if __name__ == "__main__":
    measure_main(measure, table)
