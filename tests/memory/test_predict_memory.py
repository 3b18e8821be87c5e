"""The memory prediction against the real step: each rank's predicted tensor peak within ±10% of
what torch's ``MemTracker`` measures in a real training step on real gloo ranks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, PretrainedConfig, Qwen3MoeConfig

from nemo_wrap import DistributedSetup, MemoryPredictionError, TrainingShape, predict_memory
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.cli import main
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.memory import MemoryCategory, parse_bytes
from nemo_wrap.memory.tracking import second_step_peak
from nemo_wrap.training import train_step

SHAPE = TrainingShape(batch_size=4, seq_len=128)
MEMORY_DOCS = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "memory.md"
# the goal is ±10%; the dry run runs the very code: exact on most layouts, fsdp2 at 128 tokens 4%
# over (its activations), so a drift past 5% is a bug
TOLERANCE = 0.05


def _config(tied: bool, fused: bool = False) -> LlamaConfig:
    """The Llama of these tests: transformers' class, or nemo_wrap's fused one (``fused``), which
    has a sequence-parallel plan."""
    return LlamaConfig(
        architectures=["LlamaForCausalLM"] if fused else None,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=tied,
    )


def _moe_config() -> PretrainedConfig:
    """A two-layer Qwen3-MoE of the Llama's width, 4 experts, 2 a token: its experts run ``_grouped_mm``."""
    return Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
    )


def _setup(layout: str, world_size: int) -> DistributedSetup:
    if layout == "one":
        return DistributedSetup.single_process()
    if layout == "ddp":
        return DistributedSetup.build("ddp", world_size)
    if layout == "cp":
        return DistributedSetup.build("fsdp2", world_size, cp_size=2)
    if layout == "ep":
        return DistributedSetup.build("fsdp2", world_size, ep_size=2)
    if layout == "pp-ep":
        return DistributedSetup.build("fsdp2", world_size, pp_size=2, ep_size=2)
    if layout == "sequence-parallel":
        return DistributedSetup.build("fsdp2", world_size, tp_size=2, sequence_parallel=True)
    if layout in ("gpipe", "1f1b"):
        return DistributedSetup.build("fsdp2", world_size, pp_size=2, pp_schedule=layout)
    return DistributedSetup.build("fsdp2", world_size, tp_size=2 if layout == "tp" else 1)


def _options(lora: bool) -> LoadOptions:
    return LoadOptions(seed=0, peft_config=LoraConfig(r=8, target_modules="all-linear") if lora else None)


def case_measured_peak(
    tied: bool, layout: str, world_size: int, shape: TrainingShape, lora: bool = False, moe: bool = False
) -> int:
    """This rank's tensor peak in the second of two real training steps of ``shape``."""
    torch.set_num_threads(1)
    setup = _setup(layout, world_size)
    config = _moe_config() if moe else _config(tied, fused=setup.sequence_parallel)
    model = NeMoAutoModelForCausalLM.from_config(config, setup, options=_options(lora))
    if shape.activation_checkpointing:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = torch.randint(0, 4096, (shape.batch_size, shape.seq_len), generator=torch.Generator().manual_seed(0))
    micro_batches = [{"input_ids": rows}] * shape.accumulation
    return second_step_peak(model, optimizer, micro_batches, lambda batches: train_step(model, optimizer, batches))[
        "Total"
    ]


def _assert_close(predicted: list[int], measured: list[int]) -> None:
    ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
    assert all(abs(ratio - 1) <= TOLERANCE for ratio in ratios), (predicted, measured, ratios)


ACCUMULATED = TrainingShape(batch_size=2, seq_len=128, accumulation=3)


@pytest.mark.parametrize(("shape", "lora"), [(SHAPE, False), (ACCUMULATED, False), (SHAPE, True)], ids=str)
def test_one_process_prediction_matches_the_measured_peak(shape, lora):
    predicted = predict_memory(_config(tied=False), None, shape, _options(lora))
    assert [rank.rank for rank in predicted.per_rank] == [0]
    _assert_close([predicted.peak_bytes], [case_measured_peak(False, "one", 1, shape, lora)])


RECOMPUTED = TrainingShape(batch_size=4, seq_len=256, activation_checkpointing=True)


@pytest.mark.parametrize(
    ("tied", "layout", "shape"),
    [  # untied fsdp2 at SHAPE: to the byte, below
        (True, "fsdp2", SHAPE),
        (False, "tp", SHAPE),
        (True, "ddp", SHAPE),
        (False, "cp", SHAPE),
        (False, "fsdp2", RECOMPUTED),
        (False, "ddp", RECOMPUTED),
        (True, "tp", RECOMPUTED),
        (False, "fsdp2", ACCUMULATED),
        (True, "ddp", ACCUMULATED),
    ],
    ids=str,
)
def test_two_rank_predictions_match_each_rank_s_measured_peak(ranks2, tied, layout, shape):
    predicted = predict_memory(_config(tied), _setup(layout, 2), shape)
    measured = ranks2.run(case_measured_peak, tied, layout, 2, shape)
    assert [rank.rank for rank in predicted.per_rank] == [0, 1]
    _assert_close([rank.peak_bytes for rank in predicted.per_rank], measured)


def test_sequence_parallel_predictions_match_each_rank_s_measured_peak_and_keep_less(ranks2):
    config, whole = _config(tied=False, fused=True), _setup("tp", 2)
    predicted = predict_memory(config, _setup("sequence-parallel", 2), RECOMPUTED)
    measured = ranks2.run(case_measured_peak, False, "sequence-parallel", 2, RECOMPUTED)
    _assert_close([rank.peak_bytes for rank in predicted.per_rank], measured)
    kept = [dict(prediction.per_rank[0].breakdown)[MemoryCategory.ACTIVATIONS]
            for prediction in (predicted, predict_memory(config, whole, RECOMPUTED))]  # fmt: skip
    assert kept[0] < kept[1], kept


def test_fsdp2_s_gathered_layers_and_buffers_are_counted_to_the_byte(ranks2):
    """They are made from sizes alone: made real in the dry run (before ``LargeAllocationsFake``)
    they were counted 1% over; made fake, exactly."""
    predicted = predict_memory(_config(False), _setup("fsdp2", 2), SHAPE)
    assert [rank.peak_bytes for rank in predicted.per_rank] == ranks2.run(case_measured_peak, False, "fsdp2", 2, SHAPE)


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_lora_predictions_match_each_rank_s_measured_peak(ranks2, layout):
    predicted = predict_memory(_config(tied=False), _setup(layout, 2), SHAPE, _options(lora=True))
    measured = ranks2.run(case_measured_peak, False, layout, 2, SHAPE, True)
    assert [rank.rank for rank in predicted.per_rank] == [0, 1]
    _assert_close([rank.peak_bytes for rank in predicted.per_rank], measured)


def test_a_float32_moe_prediction_matches_the_measured_peak():
    # the fake kernel of the experts' grouped matmul takes bfloat16 only; the real CPU one float32 too
    predicted = predict_memory(_moe_config(), None, SHAPE)
    _assert_close([predicted.peak_bytes], [case_measured_peak(False, "one", 1, SHAPE, moe=True)])


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_moe_predictions_match_each_rank_s_measured_peak(ranks2, layout):
    predicted = predict_memory(_moe_config(), _setup(layout, 2), RECOMPUTED)
    measured = ranks2.run(case_measured_peak, False, layout, 2, RECOMPUTED, moe=True)
    _assert_close([rank.peak_bytes for rank in predicted.per_rank], measured)


@pytest.mark.parametrize("shape", [SHAPE, RECOMPUTED], ids=str)
def test_expert_parallel_predictions_are_within_the_goal_of_each_rank_s_measured_peak(ranks2, shape):
    """The dry run routes tokens evenly over the experts (:mod:`nemo_wrap.memory.balanced_routing`);
    the real router does not, so the rows each expert rank receives, and its peak, differ: the goal
    (±10%) holds, not the tighter bound of the layouts the dry run runs exactly."""
    predicted = [rank.peak_bytes for rank in predict_memory(_moe_config(), _setup("ep", 2), shape).per_rank]
    measured = ranks2.run(case_measured_peak, False, "ep", 2, shape, moe=True)
    ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
    assert all(abs(ratio - 1) <= 0.10 for ratio in ratios), (predicted, measured, ratios)


IN_FLIGHT = TrainingShape(batch_size=2, seq_len=128, accumulation=4)


@pytest.mark.parametrize(
    ("tied", "schedule", "shape"),
    [
        (False, "gpipe", IN_FLIGHT),
        (True, "1f1b", IN_FLIGHT),
        (False, "1f1b", dataclasses.replace(IN_FLIGHT, accumulation=6, activation_checkpointing=True)),
    ],
    ids=str,
)
def test_pipeline_stage_predictions_match_each_stage_s_measured_peak(ranks2, tied, schedule, shape):
    """GPipe keeps every micro-batch's activations until the backwards, 1F1B at most one per stage
    after it: the stages differ, and each is predicted. The last case's 6 micro-batches are
    predicted from dry runs of 3 and 4 (:mod:`nemo_wrap.memory.step_sampling`)."""
    predicted = [rank.peak_bytes for rank in predict_memory(_config(tied), _setup(schedule, 2), shape).per_rank]
    _assert_close(predicted, ranks2.run(case_measured_peak, tied, schedule, 2, shape))


NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def qlora_measured_peak(checkpoint: Path, layout: str, world_size: int, shape: TrainingShape) -> int:
    """This rank's tensor peak in the second of two real QLoRA steps (4-bit layers need a checkpoint)."""
    torch.set_num_threads(1)
    options = dataclasses.replace(_options(lora=True), quantization_config=NF4)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, _setup(layout, world_size), options=options)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = torch.randint(0, 4096, (shape.batch_size, shape.seq_len), generator=torch.Generator().manual_seed(0))
    return second_step_peak(model, optimizer, [{"input_ids": rows}], lambda b: train_step(model, optimizer, b))["Total"]


@pytest.mark.parametrize("layout", ["one", "fsdp2"])
def test_qlora_predictions_match_each_rank_s_measured_peak(ranks2, tmp_path, layout):
    AutoModelForCausalLM.from_config(_config(tied=False)).save_pretrained(tmp_path)
    options = dataclasses.replace(_options(lora=True), quantization_config=NF4)
    predicted = [rank.peak_bytes for rank in predict_memory(tmp_path, _setup(layout, 2), SHAPE, options).per_rank]
    if layout == "one":
        measured = [qlora_measured_peak(tmp_path, layout, 1, SHAPE)]
    else:
        measured = ranks2.run(qlora_measured_peak, tmp_path, layout, 2, SHAPE)
    _assert_close(predicted, measured)


def test_the_breakdown_adds_up_and_sharding_shrinks_the_persistent_state():
    one = predict_memory(_config(tied=False), None, SHAPE).per_rank[0]
    sharded = predict_memory(_config(tied=False), _setup("fsdp2", 2), SHAPE).per_rank[0]
    assert sum(size for _, size in one.breakdown) == one.peak_bytes
    state = {MemoryCategory.PARAMETERS, MemoryCategory.OPTIMIZER_STATE}
    held = [sum(size for category, size in rank.breakdown if category in state) for rank in (one, sharded)]
    assert held[1] < 0.75 * held[0]


def test_layouts_the_dry_run_cannot_trace_are_refused_by_name():
    with pytest.raises(MemoryPredictionError, match="DDP with tensor parallel"):
        predict_memory(_config(tied=False), DistributedSetup.build("ddp", 4, tp_size=2), SHAPE)


@pytest.mark.parametrize(("text", "size"), [("80GiB", 80 * 2**30), ("512 MiB", 512 * 2**20), ("2e9", 2 * 10**9)])
def test_device_memory_sizes_are_read_in_binary_and_decimal_units(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0"])
def test_an_unreadable_device_memory_names_the_argument(text):
    with pytest.raises(InvalidSetupError, match="--device-memory"):
        parse_bytes(text, "--device-memory")


def test_the_plan_command_prints_the_prediction_as_json_and_whether_it_fits(capsys):
    """The memory guide's command, as shown there."""
    command = "plan --nproc 2 --batch-size 2 --seq-len 32 --device-memory 1MiB --json"
    assert f"nemo-wrap {command}" in MEMORY_DOCS.read_text()
    assert main(command.split()) == 0
    printed = json.loads(capsys.readouterr().out)
    memory = printed["memory"]
    assert printed["plan"].startswith("load plan:") and "fsdp2 on 2 rank(s)" in printed["plan"]
    assert memory["shape"] == {"batch_size": 2, "seq_len": 32, "accumulation": 1, "activation_checkpointing": False}
    assert memory["device_memory"] == 2**20 and memory["fits"] is False
    assert [rank["rank"] for rank in memory["per_rank"]] == [0, 1]
    for rank in memory["per_rank"]:
        assert rank["peak_bytes"] == sum(rank["breakdown"].values()) > 2**20


def test_the_plan_command_predicts_the_job_finetune_runs_its_lora_included(capsys):
    optimizer_state = []
    for lora in ([], ["--lora-r", "8"]):
        assert main(["plan", "--memory", "--json", "--batch-size", "2", *lora]) == 0
        breakdown = json.loads(capsys.readouterr().out)["memory"]["per_rank"][0]["breakdown"]
        optimizer_state.append(breakdown["optimizer_state"])
    assert 0 < optimizer_state[1] < 0.1 * optimizer_state[0]  # AdamW over the adapters only
