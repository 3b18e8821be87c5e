"""On paper, at real scale: the layouts torchtitan, NeMo Automodel and NeMo publish as working for five
models, predicted per GPU from the models' configs alone (no weights), against the GPUs they name.

Each row is one published layout: the project's file, the hardware it names, its degrees, rows per
GPU, sequence length, activation checkpointing and precision, as the file states them (the
projects' defaults where the file is silent). Where the published layout checkpoints selected ops
only (torchtitan's ``selective``), both bounds are predicted: no checkpointing (above it) and every
layer recomputed (below it). float8 layouts are predicted in bf16 (more memory, never less). Expert
parallel is predicted with tokens spread evenly over the experts (as Automodel's own benchmark runs
them: ``fake_balanced_gate``). Pipeline layouts are predicted with nemo_wrap's schedule, 1F1B with
one stage per rank, over the micro-batches one schedule runs; the projects run interleaved
schedules (several stages per rank), which nemo_wrap does not build.
Run: ``python -m benchmarks --only published_layouts`` (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Table

GIB = 2**30
TT = "https://github.com/pytorch/torchtitan/blob/238fa9953e4aec2a62582121564273d7cbb1e9f1/"
TT_NEW = "https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
AM = "https://github.com/NVIDIA-NeMo/Automodel/blob/36044ad3d139363fb6c73c24af2e7c6b65ec52f6/"
AM_MOE = "https://github.com/NVIDIA-NeMo/Automodel/blob/485651984cd97a508cc6e4be16f7fa5efdffa931/"
AM_PP = "https://github.com/NVIDIA-NeMo/Automodel/blob/9ea4d1ce6bc7f966144527d1c94c3ca081f477dc/"
AM_MIXTRAL = "https://github.com/NVIDIA-NeMo/Automodel/blob/604375acc4dd0fec46e3490bc66535f98ddcc832/"
NEMO = "https://github.com/NVIDIA/NeMo/blob/8cfedd7203462cb251a914e700e5605444277561/"


def _llama(hidden: int, intermediate: int, layers: int, heads: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],  # as Meta's config.json names it: nemo_wrap's fused class
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


def _qwen3_30b_a3b() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_experts=128,
        num_experts_per_tok=8,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    )


def _mixtral_8x7b() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )


MODELS = {
    "Llama-3-8B": lambda: _llama(4096, 14336, 32, 32),
    "Llama-3-70B": lambda: _llama(8192, 28672, 80, 64),
    "Llama-3.1-405B": lambda: _llama(16384, 53248, 126, 128),
    "Mixtral-8x7B": _mixtral_8x7b,
    "Qwen3-30B-A3B": _qwen3_30b_a3b,
}


@dataclass(frozen=True)
class Published:
    """One published layout, as its file states it."""

    model: str
    source: str  # the project and its file, as a markdown link
    hardware: str  # as the source names it
    gpus: int
    tp: int
    cp: int
    rows: int  # per GPU per micro-batch
    seq_len: int
    checkpointing: str  # none | selective | full
    precision: str  # bf16-mixed | bf16
    lora_rank: int = 0
    device_gib: int = 80  # the named GPU's memory; 80 GB where the source does not say
    ep: int = 1
    pp: int = 1  # stages, run by 1F1B
    micro_batches: int = 1  # per pipeline schedule
    sequence_parallel: bool = False  # tensor parallel's stream cut along the sequence, as the source sets it

    def setup(self) -> Any:
        from nemo_wrap import DistributedSetup

        if self.gpus == 1:
            return DistributedSetup.single_process()
        degrees = {"tp_size": self.tp, "cp_size": self.cp, "ep_size": self.ep, "pp_size": self.pp}
        return DistributedSetup.build("fsdp2", self.gpus, **degrees, sequence_parallel=self.sequence_parallel)

    @property
    def data_parallel(self) -> int:
        """The ranks that share each step's rows: the GPUs over tp, cp and pp."""
        return self.gpus // (self.tp * self.cp * self.pp)

    def degrees(self) -> str:
        parts = [f"fsdp {self.data_parallel}"] if self.gpus > 1 else ["one GPU"]
        named = (("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("ep", self.ep))
        cut = " (sequence parallel)" if self.sequence_parallel else ""
        return " × ".join(parts + [f"{name} {size}" for name, size in named if size > 1]) + cut

    def options(self) -> Any:
        from peft import LoraConfig

        from nemo_wrap.loading.options import LoadOptions

        lora = LoraConfig(r=self.lora_rank, lora_alpha=2 * self.lora_rank, target_modules=r".*_proj")
        return LoadOptions(precision=self.precision, peft_config=lora if self.lora_rank else None)


def _link(label: str, base: str, path: str) -> str:
    return f"[{label}]({base}{path})"


PUBLISHED = [
    Published(
        "Llama-3-8B",
        _link("torchtitan `llama3_8b.toml`", TT, "torchtitan/models/llama3/train_configs/llama3_8b.toml"),
        "64 A100",
        64,
        1,
        1,
        1,
        8192,
        "selective",
        "bf16-mixed",
    ),
    Published(
        "Llama-3-8B",
        _link("torchtitan benchmark, table 1", TT_NEW, "benchmarks/llama3_h100_202412_torchtitan.md"),
        "8 H100 96 GB",
        8,
        1,
        1,
        2,
        8192,
        "selective",
        "bf16-mixed",
        device_gib=96,
    ),
    Published(
        "Llama-3-8B",
        _link(
            "Automodel full SFT, tp",
            AM,
            "examples/llm_finetune/llama3_1/customizer_llama_3_1_8b_full_sft_tp.yaml",
        ),
        "8 GPUs",
        8,
        2,
        1,
        1,
        2048,
        "none",
        "bf16",
    ),
    Published(
        "Llama-3-8B",
        _link("Automodel LoRA benchmark", AM, "examples/llm_benchmark/llama3_1/llama3_1_8b_peft_benchmark.yaml"),
        "1 H100",
        1,
        1,
        1,
        2,
        4096,
        "none",
        "bf16",
        lora_rank=16,
    ),
    Published(
        "Llama-3-70B",
        _link("torchtitan `llama3_70b.toml`", TT, "torchtitan/models/llama3/train_configs/llama3_70b.toml"),
        "64 A100",
        64,
        8,
        1,
        8,
        8192,
        "full",
        "bf16-mixed",
        sequence_parallel=True,
    ),
    Published(
        "Llama-3-70B",
        _link(
            "Automodel pretrain benchmark, 8 nodes",
            AM,
            "examples/llm_benchmark/llama3_3/custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml",
        ),
        "64 H100",
        64,
        1,
        2,
        1,
        8192,
        "full",
        "bf16-mixed",
    ),
    Published(
        "Llama-3-70B",
        _link(
            "Automodel LoRA benchmark",
            AM,
            "examples/llm_benchmark/llama3_3/custom_llama3_3_70b_instruct_peft_benchmark.yaml",
        ),
        "8 H100",
        8,
        2,
        1,
        2,
        4096,
        "full",
        "bf16",
        lora_rank=16,
        sequence_parallel=True,
    ),
    Published(
        "Llama-3-70B",
        _link(
            "Automodel LoRA benchmark, 2 nodes",
            AM,
            "examples/llm_benchmark/llama3_3/custom_llama3_3_70b_instruct_peft_benchmark_2nodes.yaml",
        ),
        "16 H100",
        16,
        2,
        1,
        2,
        4096,
        "full",
        "bf16",
        lora_rank=16,
        sequence_parallel=True,
    ),
    Published(
        "Llama-3.1-405B",
        _link("torchtitan `llama3_405b.toml` (float8)", TT, "torchtitan/models/llama3/train_configs/llama3_405b.toml"),
        "128 H100",
        128,
        8,
        1,
        2,
        8192,
        "full",
        "bf16-mixed",
        sequence_parallel=True,
    ),
    Published(
        "Qwen3-30B-A3B",
        _link("torchtitan `qwen3_30b_a3b`", TT_NEW, "torchtitan/models/qwen3/config_registry.py"),
        "not named: 8 GPUs",
        8,
        1,
        1,
        2,
        4096,
        "full",
        "bf16-mixed",
    ),
    Published(
        "Qwen3-30B-A3B",
        _link("torchtitan `qwen3_30b_a3b`", TT_NEW, "torchtitan/models/qwen3/config_registry.py"),
        "not named: 64 GPUs",
        64,
        1,
        1,
        2,
        4096,
        "full",
        "bf16-mixed",
    ),
    Published(  # precision not stated: bf16-mixed (fp32 parameters and state: more memory, never less)
        "Qwen3-30B-A3B",
        _link("Automodel `qwen3_moe_30b_torch.yaml`", AM_MOE, "examples/benchmark/configs/qwen3_moe_30b_torch.yaml"),
        "8 H100",
        8,
        1,
        1,
        4,
        4096,
        "full",
        "bf16-mixed",
        ep=8,
    ),
    Published(
        "Llama-3.1-405B",
        _link("torchtitan benchmark, table 5", TT_NEW, "benchmarks/llama3_h100_202412_torchtitan.md"),
        "512 H100 96 GB",
        512,
        8,
        1,
        1,
        8192,
        "full",
        "bf16-mixed",
        device_gib=96,
        pp=8,
        micro_batches=32,
    ),
    Published(
        "Llama-3-70B",
        _link("Automodel `llama3_70b_pretrain.yaml`", AM_PP, "examples/llm_pretrain/llama3_70b_pretrain.yaml"),
        "not named: 32 GPUs",
        32,
        4,
        1,
        1,
        4096,
        "full",
        "bf16",
        pp=4,
        micro_batches=4,
    ),
    Published(
        "Mixtral-8x7B",
        _link(
            "Automodel `mixtral-8x7b-v0-1_squad.yaml`",
            AM_MIXTRAL,
            "examples/llm_finetune/mistral/mixtral-8x7b-v0-1_squad.yaml",
        ),
        "32 H200",
        32,
        1,
        1,
        4,
        1024,
        "none",
        "bf16",
        device_gib=140,
        pp=8,
        micro_batches=8,
    ),
    Published(
        "Mixtral-8x7B",
        _link("NeMo `mixtral_8x7b.py`", NEMO, "nemo/collections/llm/recipes/mixtral_8x7b.py"),
        "64 GPUs",
        64,
        1,
        1,
        1,
        4096,
        "none",
        "bf16-mixed",
        ep=8,
        pp=4,
        micro_batches=32,
    ),
]


def _peak(layout: Published, recompute: bool) -> int:
    from nemo_wrap.memory import TrainingShape, predict_memory

    shape = TrainingShape(layout.rows, layout.seq_len, layout.micro_batches, activation_checkpointing=recompute)
    ranks = sorted({0, layout.gpus - 1})  # the last rank's shards are the smallest where sizes do not divide
    return predict_memory(MODELS[layout.model](), layout.setup(), shape, layout.options(), ranks=ranks).peak_bytes


def _predicted(layout: Published) -> str:
    """The predicted peak per GPU, as bounds where the layout checkpoints selected ops only; the
    reason, where nemo_wrap refuses the layout."""
    from nemo_wrap.errors import NeMoWrapError

    device = layout.device_gib * GIB
    try:
        if layout.checkpointing != "selective":
            peak = _peak(layout, layout.checkpointing == "full")
            return f"{peak / GIB:.1f} ({'fits' if peak <= device else 'over'})"
        above, below = _peak(layout, False), _peak(layout, True)
    except NeMoWrapError as error:
        return f"not in nemo_wrap: {str(error).partition(': ')[2]}"
    verdict = "fits" if above <= device else ("fits recomputed" if below <= device else "over")
    return f"{below / GIB:.1f} – {above / GIB:.1f} ({verdict})"


def table() -> Table:
    result = Table(
        "Published layout",
        ["model", "hardware", "degrees", "rows × tokens", "checkpointing", "precision", "predicted GiB per GPU"],
    )
    for layout in PUBLISHED:
        tokens = f"{layout.rows} × {layout.seq_len}" + (
            f", {layout.micro_batches} in the pipeline" if layout.pp > 1 else ""
        )
        lora = f", LoRA r {layout.lora_rank}" if layout.lora_rank else ""
        started = time.perf_counter()
        predicted = _predicted(layout)
        print(layout.model, layout.degrees(), predicted, f"{time.perf_counter() - started:.0f} s", flush=True)
        cells = [layout.model, layout.hardware, layout.degrees(), tokens, layout.checkpointing]
        result.rows.append([layout.source, *cells, layout.precision + lora, predicted])
    result.note = (
        "Predicted: `predict_memory` on the model's config (no weights), the first and last rank, the peak of the "
        "higher; against the named GPU's memory, 80 GiB where the source names none. `selective`: torchtitan "
        "checkpoints selected ops; the bounds are no checkpointing (above) and every layer recomputed (below). "
        "Precision `bf16-mixed`: fp32 parameters and AdamW state, bf16 compute (torchtitan's default); `bf16`: bf16 "
        "parameters and state (Automodel's `torch_dtype: bfloat16` with Adam). Deep models and pipeline stages are "
        "dry-run at depths 4 and 5 and extrapolated, long 1F1B steps at P + 1 and P + 2 micro-batches "
        "(docs/how-to/memory.md). Tensor parallel is nemo_wrap's, with sequence parallel where the "
        "source turns it on (torchtitan always; Automodel's `sequence_parallel: true`), except beside pipeline "
        "stages, where nemo_wrap refuses it: there the layer inputs that checkpointing keeps are whole on every "
        "tensor-parallel rank. Pipeline layouts: 1F1B, one stage per rank (the sources run interleaved 1F1B); "
        "torchtitan measured 82.5 GiB for its 405B layout with 1F1B (float8, torch.compile, asynchronous TP with "
        "sequence parallel)."
    )
    return result


if __name__ == "__main__":
    print(table().markdown())
