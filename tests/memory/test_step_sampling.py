"""A large step predicted from dry runs of smaller ones: the decision, the lines through two depths
and through two micro-batch counts, which layers count as alike, and the sampled prediction against
the whole trace and the measured peak."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3MoeConfig

from nemo_wrap import DistributedSetup, TrainingShape, predict_memory
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.memory import MemoryCategory, RankMemory
from nemo_wrap.memory.dry_run import step_sampling
from nemo_wrap.memory.prediction import StepPhase
from nemo_wrap.memory.step_sampling import (
    CHECK_DEPTH,
    SAMPLED_DEPTHS,
    SLOPE_DEPTH,
    TRACED_WHOLE_UP_TO,
    DryRunSize,
    StepSampling,
    layers_alike,
    sample_step,
    with_depth,
)
from tests.memory.test_predict_memory import TOLERANCE, case_measured_peak

DEEP = TRACED_WHOLE_UP_TO + 1
SAMPLED = (*SAMPLED_DEPTHS, CHECK_DEPTH)
FB, OPT = StepPhase.FORWARD_BACKWARD, StepPhase.OPTIMIZER_STEP


def _llama(layers: int = DEEP) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.mark.parametrize("layers", range(1, 2 * TRACED_WHOLE_UP_TO))
@pytest.mark.parametrize("alike", [True, False])
def test_the_decision_samples_only_many_alike_layers(layers, alike):
    sampling = sample_step((layers,), 4, alike, one_f_one_b=True)
    sampled = alike and layers > TRACED_WHOLE_UP_TO
    assert sampling.sizes == tuple(DryRunSize(d, 4) for d in (SAMPLED if sampled else (layers,)))
    assert (sampling.samples_layers, sampling.samples_micro_batches) == (sampled, False)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", range(1, 13))
@pytest.mark.parametrize("one_f_one_b", [True, False])
def test_the_decision_samples_the_micro_batches_of_a_long_1f1b_step_only(stages, micro_batches, one_f_one_b):
    sampling = sample_step((TRACED_WHOLE_UP_TO,) * stages, micro_batches, True, one_f_one_b)
    sampled = one_f_one_b and micro_batches > stages + 2
    assert sampling.samples_micro_batches is sampled
    whole = stages * TRACED_WHOLE_UP_TO
    slope = [DryRunSize(stages * SLOPE_DEPTH, stages + 1), DryRunSize(stages * SLOPE_DEPTH, stages + 2)]
    expected = [DryRunSize(whole, stages + 1), *slope] if sampled else [DryRunSize(whole, micro_batches)]
    assert list(sampling.sizes) == expected


def test_stages_of_unlike_layers_take_the_micro_batch_line_through_whole_steps():
    sampling = sample_step((30, 2), 9, alike=False, one_f_one_b=True)
    assert sampling.sizes == (DryRunSize(32, 3), DryRunSize(32, 4))
    # one stage too short: no layer is sampled, in any stage
    assert not sample_step((30, 2), 9, alike=True, one_f_one_b=True).samples_layers


def _rank(depth: int, per_layer: int = 10, fixed: int = 100, per_batch: int = 0, batches: int = 0) -> RankMemory:
    """A rank whose peak grows ``per_layer`` bytes of parameters and 3 of activations a layer, and
    ``per_batch`` bytes of temporaries a micro-batch."""
    parts = (
        (MemoryCategory.PARAMETERS, fixed + per_layer * depth),
        (MemoryCategory.ACTIVATIONS, 50 + 3 * depth),
        (MemoryCategory.TEMPORARIES, per_batch * batches),
    )
    return RankMemory(1, sum(size for _, size in parts), parts)


def _sampled_layers(depth: int) -> StepSampling:
    return StepSampling((depth,), 1, True, samples_layers=True, samples_micro_batches=False)


def test_the_line_through_two_depths_gives_every_category_at_full_depth():
    sampling = _sampled_layers(40)
    traced = {DryRunSize(d, 1): {FB: _rank(d)} for d in SAMPLED}
    assert sampling.combine(traced, stage=0) == _rank(40)
    whole = StepSampling((3,), 1, True, False, False)
    assert whole.combine({DryRunSize(3, 1): {FB: _rank(3)}}, stage=0) == _rank(3)
    with pytest.raises(MemoryPredictionError):
        sampling.combine({DryRunSize(4, 1): {FB: _rank(4)}}, stage=0)


def test_each_phase_has_its_line_and_the_steeper_one_wins_past_the_sampled_depths():
    """The backward peaks higher at 4 and 5 layers, the optimizer step (steeper) at 10 and 40."""

    def phases(depth: int) -> dict[StepPhase, RankMemory]:
        return {FB: _rank(depth, 10, 500), OPT: _rank(depth, 30, 300)}

    assert phases(5)[FB].peak_bytes > phases(5)[OPT].peak_bytes
    traced = {DryRunSize(d, 1): phases(d) for d in SAMPLED}
    assert _sampled_layers(40).combine(traced, stage=0) == _rank(40, 30, 300)


def test_a_line_that_misses_the_peak_at_the_check_depth_asks_for_the_whole_trace():
    """Within one phase a steeper moment takes over between the sampled depths and the check."""

    def steeper_from_eight(depth: int) -> RankMemory:
        return max(_rank(depth, 10, 500), _rank(depth, 30, 340), key=lambda rank: rank.peak_bytes)

    missed = {DryRunSize(d, 1): {FB: steeper_from_eight(d)} for d in SAMPLED}
    assert _sampled_layers(40).combine(missed, stage=0) is None


def test_a_stage_takes_the_layer_line_at_its_own_depth_and_adds_the_micro_batch_line():
    """Two stages of 25 and 24 layers over 9 micro-batches: each rank's line at its stage's depth,
    plus 6 micro-batches' growth (7 bytes each) past the 3 traced."""
    sampling = sample_step((25, 24), 9, alike=True, one_f_one_b=True)
    assert sampling.samples_layers and sampling.samples_micro_batches

    def traced(size: DryRunSize) -> dict[StepPhase, RankMemory]:
        per_stage = size.layers // 2
        return {FB: _rank(per_stage, per_batch=7, batches=size.micro_batches)}

    runs = {size: traced(size) for size in sampling.sizes}
    assert sorted({size.micro_batches for size in sampling.sizes}) == [3, 4]
    for stage, depth in enumerate((25, 24)):
        assert sampling.combine(runs, stage) == _rank(depth, per_batch=7, batches=9)


def _alike(config: PretrainedConfig) -> bool:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return layers_alike(decoder_layers(model), config)


def test_layers_differing_in_structure_or_in_the_configs_per_layer_lists_are_not_alike():
    assert _alike(_llama())
    small: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    small |= {"num_key_value_heads": 2, "vocab_size": 256, "num_hidden_layers": 10}
    moe = small | {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    assert _alike(Qwen3MoeConfig(**moe))
    assert not _alike(Qwen3MoeConfig(**moe, mlp_only_layers=[0]))  # a dense first layer
    # full attention on four layers, sliding windows on the rest
    assert not _alike(Qwen2Config(**small, use_sliding_window=True, max_window_layers=4))


def test_a_config_cut_to_a_depth_cuts_its_per_layer_lists_and_leaves_the_original():
    config = Qwen2Config(num_hidden_layers=10, layer_types=["full_attention"] * 10)
    cut = with_depth(config, 3)
    assert (cut.num_hidden_layers, cut.layer_types) == (3, ["full_attention"] * 3)
    assert (config.num_hidden_layers, len(config.layer_types)) == (10, 10)


def test_a_deep_model_and_a_deep_stage_are_sampled_a_shallow_one_traced_whole():
    one = DistributedSetup.single_process()
    shape = TrainingShape()
    assert step_sampling(_llama(), _options(), one, shape).sizes == tuple(DryRunSize(d, 1) for d in SAMPLED)
    shallow = step_sampling(_llama(TRACED_WHOLE_UP_TO), _options(), one, shape)
    assert shallow.sizes == (DryRunSize(TRACED_WHOLE_UP_TO, 1),)
    staged = DistributedSetup.build("fsdp2", 2, pp_size=2, pp_layer_split=(DEEP + 1, DEEP))
    sampling = step_sampling(_llama(2 * DEEP + 1), _options(), staged, TrainingShape(accumulation=5))
    assert sampling.stage_layers == (DEEP + 1, DEEP)
    assert sampling.samples_layers and sampling.samples_micro_batches
    assert f"traced 4, 5 and 10 a stage of {DEEP + 1}" in sampling.describe()
    # a stage of TRACED_WHOLE_UP_TO layers: every stage traced whole
    uneven = DistributedSetup.build("fsdp2", 2, pp_size=2, pp_layer_split=(DEEP + 1, DEEP - 1))
    assert not step_sampling(_llama(2 * DEEP), _options(), uneven, TrainingShape(accumulation=5)).samples_layers


def _options() -> LoadOptions:
    return LoadOptions(seed=0)


def test_the_sampled_prediction_equals_the_whole_trace_on_fsdp2(monkeypatch):
    """Two ranks of fsdp2, no checkpointing: one moment (the loss) holds the peak at every depth."""
    setup, shape = DistributedSetup.build("fsdp2", 2), TrainingShape(batch_size=2, seq_len=128)
    monkeypatch.setattr("nemo_wrap.memory.step_sampling.TRACED_WHOLE_UP_TO", CHECK_DEPTH)  # a shorter whole trace
    config = _llama(CHECK_DEPTH + 2)
    sampled = predict_memory(config, setup, shape)
    monkeypatch.setattr("nemo_wrap.memory.step_sampling.TRACED_WHOLE_UP_TO", CHECK_DEPTH + 2)
    whole = predict_memory(config, setup, shape)
    assert "traced 4, 5 and 10 of 12" in sampled.traced and "all 12" in whole.traced
    assert [r.peak_bytes for r in sampled.per_rank] == [r.peak_bytes for r in whole.per_rank]


def test_the_sampled_prediction_of_one_process_matches_the_measured_peak(monkeypatch):
    shape = TrainingShape(batch_size=2, seq_len=128)
    predicted = predict_memory(_llama(), DistributedSetup.single_process(), shape).peak_bytes
    monkeypatch.setattr("tests.memory.test_predict_memory._config", lambda tied, fused=False: _llama())
    measured = case_measured_peak(False, "one", 1, shape)
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)


def test_a_sampled_1f1b_pipeline_equals_its_whole_trace_on_every_stage(monkeypatch):
    """pp 2 over stages of 12 and 11 layers (sampled from 11 on here, to keep the whole trace short)
    and 5 micro-batches, recomputed: traced at 4, 5 and 10 layers a stage over 3 micro-batches, and
    at one layer a stage over 3 and 4; equal to the byte to the trace of every layer and
    micro-batch, on both stages."""
    monkeypatch.setattr("nemo_wrap.memory.step_sampling.TRACED_WHOLE_UP_TO", CHECK_DEPTH)
    setup = DistributedSetup.build("fsdp2", 2, pp_size=2)
    shape = TrainingShape(batch_size=1, seq_len=64, accumulation=5, activation_checkpointing=True)
    config = _llama(2 * CHECK_DEPTH + 3)
    sampled = predict_memory(config, setup, shape)
    assert "traced 4, 5 and 10 a stage of 12" in sampled.traced and "3 and 4 of 5 micro-batches" in sampled.traced

    def whole(stages: Any, micro_batches: int, alike: bool, one_f_one_b: bool) -> StepSampling:
        return StepSampling(tuple(stages), micro_batches, alike, samples_layers=False, samples_micro_batches=False)

    monkeypatch.setattr("nemo_wrap.memory.dry_run.sample_step", whole)
    traced = predict_memory(config, setup, shape)
    assert "all 23 decoder layer(s) (12, 11 by stage)" in traced.traced
    assert sampled.per_rank == traced.per_rank
