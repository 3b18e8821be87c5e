"""QLoRA: 4-bit loads, a QLoRA training step and a QLoRA chat SFT run, against transformers + PEFT.

Every case runs in a fresh process (or a fresh torchrun job on 2 ranks × 1 thread); 4 bits means
bitsandbytes NF4 with double quantization, computing in fp32 (``BitsAndBytesConfig``).
- ``qlora_load``: ``from_pretrained`` with that config (no adapters) of the 1.1B bf16 Llama of the
  load benchmark and of SmolLM2-135M-Instruct (fp32, loaded with ``dtype=torch.bfloat16``): ours in
  one process, ours under fsdp2 on 2 ranks, transformers' ``AutoModelForCausalLM.from_pretrained``
  with the same config. The time is the call alone (imports excluded) plus touching every page of
  what the model holds; the peak is VmHWM above the RSS after imports; "held" is the bytes of the
  parameters and buffers a rank holds (its local shard of a DTensor; for transformers' ``Linear4bit``
  also the quantization state beside each weight), against the bf16 base (every parameter of the
  unquantized model at 2 bytes). For SmolLM2 the logits of ours (one process) and of transformers'
  4-bit model on 2 × 32 fixed token ids are compared, after the peak is read.
  Targets: peak RSS ≤ 1.2 × (held + 32 MiB, the largest chunk a rank reads); per rank on 2 ranks,
  held ≤ 0.3 × the bf16 base.
- ``qlora_step``: one training step of the 100M fp32 Llama of the LoRA benchmark, 2 × 256 tokens,
  AdamW, LoRA r=16 on all linear layers: LoRA, QLoRA, PEFT over transformers' 4-bit model, and
  QLoRA under fsdp2 on 2 ranks (the same 2 rows per step, one a rank). Median step of 6 after a
  warm-up, RSS after loading, peak RSS.
- ``qlora_sft``: the SFT recipe (``run_sft``) on SmolLM2-135M-Instruct with the bundled chat set,
  QLoRA r=16 all-linear, 4 packed rows of 256 tokens a step (2 a rank on 2 ranks), lr 1e-3, 20 steps, in one
  process and under fsdp2 on 2 ranks: first and last loss (it must fall), the median of the
  recipe's ``train_step`` calls, peak RSS per rank.
Run: ``python -m benchmarks --only qlora_load qlora_step qlora_sft`` (``python -m benchmarks.bench_qlora``
prints the load table alone).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_from_pretrained import CHECKPOINT, make_checkpoint
from benchmarks.bench_lora_step import (
    BATCH,
    CHECKPOINT_100M,
    SEQUENCE,
    STEPS,
    WARMUP,
    make_checkpoint_100m,
    measure_steps,
)
from benchmarks.common import Table, best_of, measure_main, reset_peak_rss, run_measure, status_mib, touch

MODULE = "benchmarks.bench_qlora"
LOGIT_SHAPE = (2, 32)
SFT_STEPS, SFT_LENGTH, SFT_ROWS, SFT_LR = 20, 256, 4, 1e-3  # SFT_ROWS packed rows a step, over all ranks
CHECKPOINTS = {"1b": "1.1B Llama bf16", "smol": "SmolLM2-135M-Instruct"}
LOAD_CASES = {
    "nemo": "ours, one process",
    "nemo-fsdp2": "ours, fsdp2 on 2 ranks (per rank, worst rank)",
    "transformers": "transformers + bitsandbytes, one process",
}
STEP_CASES = {
    "lora": "LoRA (ours)",
    "qlora": "QLoRA (ours, NF4 + double quant)",
    "peft": "QLoRA: PEFT over transformers' 4-bit model",
    "qlora-fsdp2": "QLoRA (ours), fsdp2 on 2 ranks (per rank)",
}
SFT_CASES = {"sft": "QLoRA SFT (ours), one process", "sft-fsdp2": "QLoRA SFT (ours), fsdp2 on 2 ranks"}


def _quantization():
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)  # fmt: skip


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")


def _checkpoint(name: str) -> Path:
    from nemo_wrap.default_model import smollm2_instruct_path

    return CHECKPOINT if name == "1b" else smollm2_instruct_path()


def _nbytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _quant_state(module) -> list[Any]:
    """The tensors transformers' ``Linear4bit`` keeps beside its 4-bit weight (absmax, code, and the
    double quantization's), which are neither parameters nor buffers."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None:
        return []
    tensors = [state.absmax, state.code] + ([state.offset] if state.offset is not None else [])
    return tensors + ([state.state2.absmax, state.state2.code] if state.state2 is not None else [])


def _held(model) -> list[Any]:
    """Every tensor the model holds: parameters, buffers, transformers' quantization states."""
    return [*model.parameters(), *model.buffers(), *(t for m in model.modules() for t in _quant_state(m))]


def _quantized_bytes(model) -> tuple[int, int]:
    """The 4-bit layers' bytes (this rank's rows) and what those rows take in bf16 (4 × the packed bytes)."""
    import bitsandbytes

    from nemo_wrap.models.quantized import QuantizedLinear

    held = bf16 = 0
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, bitsandbytes.nn.Linear4bit)):
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False), *_quant_state(module)]
            held += sum(_nbytes(t) for t in tensors)
            bf16 += 4 * _nbytes(module.weight_packed if isinstance(module, QuantizedLinear) else module.weight)
    return held, bf16


def _load_4bit(case: str, path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    if case == "transformers":
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=_quantization(), dtype=torch.bfloat16)
    setup = DistributedSetup.build("fsdp2", initialize_distributed().world_size) if case == "nemo-fsdp2" else None
    return NeMoAutoModelForCausalLM.from_pretrained(
        path, distributed_setup=setup, quantization_config=_quantization(), dtype=torch.bfloat16
    )


def _logit_difference(model, path: Path) -> float:
    """The largest |difference| between ``model``'s logits and transformers' 4-bit model's, both in the
    compute dtype (on a CPU with AVX512-BF16, bitsandbytes would otherwise repack its layers on the
    first inference call and compute in bf16 whatever the compute dtype)."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    peer = AutoModelForCausalLM.from_pretrained(path, quantization_config=_quantization(), dtype=torch.bfloat16)
    for module in peer.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    ids = torch.randint(0, peer.config.vocab_size, LOGIT_SHAPE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(input_ids=ids).logits, peer.eval()(input_ids=ids).logits
    return float((ours.float() - theirs.float()).abs().max())


def _measure_load(name: str, case: str) -> dict[str, Any]:
    import bitsandbytes  # noqa: F401 - imported before timing, like the modeling code
    import peft  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    import nemo_wrap.auto  # noqa: F401

    if case == "nemo-fsdp2":  # the process group is joined before timing, as for every other import
        from nemo_wrap import initialize_distributed

        initialize_distributed()
    path = _checkpoint(name)
    reset_peak_rss()
    baseline = status_mib("VmRSS")
    started = time.perf_counter()
    model = _load_4bit(case, path)
    touch(_held(model))
    seconds = time.perf_counter() - started
    peak_mib = status_mib("VmHWM") - baseline
    quantized, quantized_bf16 = _quantized_bytes(model)
    row = {"seconds": seconds, "peak_mib": peak_mib, "held_mib": sum(_nbytes(t) for t in _held(model)) / 2**20,
           "quantized_mib": quantized / 2**20, "quantized_bf16_mib": quantized_bf16 / 2**20,
           "block_mib": _largest_block_mib(model, path)}  # fmt: skip
    if name == "smol" and case == "nemo":
        row["logit_difference"] = _logit_difference(model, path)
    return row


def _largest_block_mib(model, path: Path) -> float:
    """The most checkpoint bytes a rank has mapped at once while reading: the rank's share of its
    largest unquantized tensor (read as one window), or one chunk of a 4-bit layer's rows."""
    from nemo_wrap.checkpoint.locate import open_checkpoint
    from nemo_wrap.loading.read import ENCODE_CHUNK_VALUES
    from nemo_wrap.state_dict import checkpoint_tensors

    entries = open_checkpoint(path).entries
    itemsize = max(entry.dtype.itemsize for entry in entries.values())
    blocks = [_nbytes(t) // t.element_size() * entries[name].dtype.itemsize
              for name, t in checkpoint_tensors(model)[0].items() if name in entries]  # fmt: skip
    return max([ENCODE_CHUNK_VALUES * itemsize, *blocks]) / 2**20


def _step_model(case: str, setup):
    if case == "peft":
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(CHECKPOINT_100M, quantization_config=_quantization())
        return get_peft_model(model, _lora_config())
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    quantization = {} if case == "lora" else {"quantization_config": _quantization()}
    return NeMoAutoModelForCausalLM.from_pretrained(
        CHECKPOINT_100M, distributed_setup=setup, peft_config=_lora_config(), **quantization
    )


def _measure_step(case: str) -> dict[str, Any]:
    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.training import train_step

    setup = DistributedSetup.build("fsdp2", initialize_distributed().world_size) if case == "qlora-fsdp2" else None
    if setup is None:
        return measure_steps(_step_model(case, None))

    def sharded_step(model: Any, optimizer: Any, tokens: Any) -> None:  # the same 2 rows a step, one a rank
        train_step(model, optimizer, [{"input_ids": tokens[setup.dp_rank() :: setup.dp_size]}])

    return measure_steps(_step_model(case, setup), sharded_step)


def _sft_config(output_dir: str, ranks: int):
    from nemo_wrap.default_model import bundled_chat_set
    from nemo_wrap.loading.options import LoadOptions
    from nemo_wrap.recipes import SFTConfig
    from nemo_wrap.recipes.config import DataSection, OptimizerSection, TrainingSection

    return SFTConfig(
        output_dir,
        data=DataSection(train=str(bundled_chat_set()), max_length=SFT_LENGTH, pack=True),
        training=TrainingSection(batch_size=SFT_ROWS // ranks, steps=SFT_STEPS),
        optimizer=OptimizerSection(lr=SFT_LR),
        load=LoadOptions(quantization_config=_quantization(), peft_config=_lora_config()),
    )


def _measure_sft(case: str) -> dict[str, Any]:
    import shutil

    import torch.distributed as dist
    from transformers import AutoTokenizer

    import nemo_wrap.recipes.sft as sft_module
    from nemo_wrap import DistributedSetup, destroy_distributed, initialize_distributed
    from nemo_wrap.default_model import smollm2_instruct_path

    times: list[float] = []
    step = sft_module.train_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = step(*args, **kwargs)
        times.append(time.perf_counter() - started)
        return result

    sft_module.train_step = timed_step  # the recipe's own steps, timed
    path, output = smollm2_instruct_path(), CHECKPOINT.parent / f"qlora-{case}-output"
    env = initialize_distributed()
    try:
        setup = DistributedSetup.build("fsdp2", env.world_size)
        records = sft_module.run_sft(
            path, setup, _sft_config(str(output), env.world_size), AutoTokenizer.from_pretrained(path), lambda *_: None
        )
        dist.barrier()
        if env.is_main_process:
            shutil.rmtree(output, ignore_errors=True)
    finally:
        destroy_distributed()
    losses = [record["loss"] for record in records if "loss" in record]
    return {"seconds": statistics.median(times), "first_loss": losses[0], "last_loss": losses[-1],
            "steps": len(losses), "peak_mib": status_mib("VmHWM")}  # fmt: skip


def measure(kind: str) -> dict[str, Any]:
    """``load-<checkpoint>-<case>``, ``step-<case>`` or ``sft``/``sft-fsdp2``."""
    if kind.startswith("load-"):
        name, case = kind.removeprefix("load-").split("-", 1)
        return _measure_load(name, case)
    if kind.startswith("step-"):
        return _measure_step(kind.removeprefix("step-"))
    return _measure_sft(kind)


def _base_parameters(path: Path) -> int:
    """The unquantized model's parameter count (built on the meta device from the config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def _load_cells(rows: list[dict[str, Any]], base_mib: float, block_mib: float) -> list[str]:
    """One load case's cells: each column's worst rank; the ratios are each rank's own, the worst.
    ``block_mib``: the block of a case that reports none (transformers': ours in one process)."""
    worst = {key: max(row[key] for row in rows) for key in ("seconds", "peak_mib", "held_mib")}
    quantized = max(row["quantized_mib"] / row["quantized_bf16_mib"] for row in rows)
    peak_ratio = max(row["peak_mib"] / (row["held_mib"] + row.get("block_mib", block_mib)) for row in rows)
    logits = f"{rows[0]['logit_difference']:.2g}" if "logit_difference" in rows[0] else "—"
    return [f"{worst['seconds']:.2f} s", f"{worst['peak_mib']:.0f} MiB", f"{worst['held_mib']:.0f} MiB",
            f"{worst['held_mib'] / base_mib:.3f}", f"{quantized:.3f}", f"{peak_ratio:.2f}", logits]  # fmt: skip


def table(repeats: int = 2) -> Table:
    """``qlora_load``: 4-bit loads of the two checkpoints, ours (1 and 2 ranks) against transformers'."""
    make_checkpoint()
    kinds = [f"load-{name}-{case}" for name in CHECKPOINTS for case in LOAD_CASES]
    best = best_of(repeats, MODULE, kinds, nproc={kind: 2 for kind in kinds if kind.endswith("fsdp2")})
    base_mib = {name: 2 * _base_parameters(_checkpoint(name)) / 2**20 for name in CHECKPOINTS}
    sizes = ", ".join(f"{CHECKPOINTS[name]} {base_mib[name]:.0f} MiB" for name in CHECKPOINTS)
    columns = ["load", "peak RSS above imports", "held", "held / bf16 base", "4-bit layers / bf16",
               "peak / (held + one block)", "max abs logit diff vs transformers"]  # fmt: skip
    result = Table(
        f"4-bit `from_pretrained` (NF4 + double quant, non-quantized weights bf16; bf16 base: {sizes})",
        columns,
        note=f"Best of {repeats} fresh processes (the run whose slowest rank was fastest), every page of what the "
        "model holds touched after loading; all cells of a row, ratios included, are of the same run (2 ranks: each "
        "column's worst rank, each ratio a rank's own). No adapters. Logits: ours (one process) against "
        "transformers' 4-bit model on 2 × 32 random token ids. One block: the most checkpoint bytes a rank maps at "
        "once (its share of the largest unquantized tensor, read whole, or one chunk of 1M values of a 4-bit layer; "
        "for transformers' row, ours in one process). Targets: peak ≤ 1.2 × (held + one block), held per rank on 2 "
        "ranks ≤ 0.3 × the bf16 base.",
    )
    for kind in kinds:
        name, case = kind.removeprefix("load-").split("-", 1)
        block = best[f"load-{name}-nemo"][0]["block_mib"]
        result.rows.append(
            [f"{CHECKPOINTS[name]}: {LOAD_CASES[case]}", *_load_cells(best[kind], base_mib[name], block)]
        )
    return result


def step_table() -> Table:
    """``qlora_step``: one LoRA / QLoRA step of the 100M Llama, ours against PEFT over transformers."""
    make_checkpoint_100m()
    rows = {case: run_measure(MODULE, f"step-{case}", 2 if case.endswith("fsdp2") else 1) for case in STEP_CASES}
    peer = rows["peft"][0]
    result = Table(
        f"training step, 100M Llama fp32, {BATCH} × {SEQUENCE} tokens, AdamW, LoRA r=16 all-linear",
        ["step", "RSS after loading", "peak RSS", "trainable parameters", "step / PEFT", "peak / PEFT"],
        note=f"Median of {STEPS} steps after {WARMUP} warm-up, each case in a fresh process; 4 bits: NF4 + double "
        "quant, computing in fp32. On 2 ranks (× 1 thread) the same 2 rows a step, one a rank; memory per rank "
        "(rank 0 / 1), ratios of the worst rank.",
    )
    for case, label in STEP_CASES.items():
        step, peak = max(r["seconds"] for r in rows[case]), max(r["peak_mib"] for r in rows[case])
        loaded = " / ".join(f"{r['loaded_mib']:.0f}" for r in rows[case])
        peaks = " / ".join(f"{r['peak_mib']:.0f}" for r in rows[case])
        result.rows.append([label, f"{step:.2f} s", f"{loaded} MiB", f"{peaks} MiB",
                            f"{rows[case][0]['trainable'] / 1e6:.1f} M", f"{step / peer['seconds']:.2f}",
                            f"{peak / peer['peak_mib']:.2f}"])  # fmt: skip
    return result


def sft_table() -> Table:
    """``qlora_sft``: the SFT recipe with QLoRA on SmolLM2-135M-Instruct and the bundled chat set."""
    result = Table(
        f"QLoRA chat SFT, SmolLM2-135M-Instruct fp32, bundled chat set, {SFT_STEPS} steps of {SFT_ROWS} "
        f"packed rows × {SFT_LENGTH} tokens, lr {SFT_LR:g}",
        ["first-step loss", "last-step loss", "step (median)", "peak RSS (rank 0 / 1)"],
        note="`run_sft` with NF4 + double quant and LoRA r=16 all-linear, each case in a fresh process (2 ranks × 1 "
        f"thread: data parallel, {SFT_ROWS // 2} rows a rank, the same global batch); the step is the recipe's "
        "`train_step` call, the slowest rank's.",
    )
    for case, label in SFT_CASES.items():
        rows = run_measure(MODULE, case, 2 if case.endswith("fsdp2") else 1)
        peaks = " / ".join(f"{r['peak_mib']:.0f}" for r in rows)
        result.rows.append([label, f"{rows[0]['first_loss']:.3f}", f"{rows[0]['last_loss']:.3f}",
                            f"{max(r['seconds'] for r in rows):.2f} s", f"{peaks} MiB"])  # fmt: skip
    return result


if __name__ == "__main__":
    measure_main(measure, table)  # (the step and SFT tables print via benchmarks: --only qlora_step qlora_sft)
