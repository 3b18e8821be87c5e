"""A deep model predicted from dry runs of two and three of its layers: the decision, the line, which
layers count as alike, and the sampled prediction against the whole trace and the measured peak."""

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
from nemo_wrap.memory.dry_run import layer_sampling
from nemo_wrap.memory.layer_sampling import (
    CHECK_DEPTH,
    SAMPLED_DEPTHS,
    TRACED_WHOLE_UP_TO,
    LayerSampling,
    layers_alike,
    sample_layers,
    with_depth,
)
from nemo_wrap.memory.prediction import StepPhase
from tests.memory.test_predict_memory import TOLERANCE, case_measured_peak

DEEP = 12


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
    sampling = sample_layers(layers, alike)
    sampled = alike and layers > TRACED_WHOLE_UP_TO
    assert sampling.traced_depths == ((*SAMPLED_DEPTHS, CHECK_DEPTH) if sampled else (layers,))
    assert sampling.extrapolates is sampled


def _rank(depth: int, per_layer: int = 10, fixed: int = 100) -> RankMemory:
    """A rank whose peak grows ``per_layer`` bytes of parameters and 3 of activations a layer."""
    parts = ((MemoryCategory.PARAMETERS, fixed + per_layer * depth), (MemoryCategory.ACTIVATIONS, 50 + 3 * depth))
    return RankMemory(1, sum(size for _, size in parts), parts)


def test_the_line_through_two_depths_gives_every_category_at_full_depth():
    sampling = LayerSampling(40, (2, 3, 10))
    assert sampling.combine([{StepPhase.FORWARD_BACKWARD: _rank(d)} for d in (2, 3, 10)]) == _rank(40)
    assert LayerSampling(3, (3,)).combine([{StepPhase.FORWARD_BACKWARD: _rank(3)}]) == _rank(3)
    with pytest.raises(MemoryPredictionError):
        sampling.combine([{StepPhase.FORWARD_BACKWARD: _rank(2)}, {StepPhase.FORWARD_BACKWARD: RankMemory(0, 1, ())}])


def test_each_phase_has_its_line_and_the_steeper_one_wins_past_the_sampled_depths():
    """The backward peaks higher at 2 and 3 layers, the optimizer step (steeper) at 10 and 40."""

    def phases(depth: int) -> dict[StepPhase, RankMemory]:
        return {StepPhase.FORWARD_BACKWARD: _rank(depth, 10, 500), StepPhase.OPTIMIZER_STEP: _rank(depth, 30, 100)}

    assert phases(3)[StepPhase.FORWARD_BACKWARD].peak_bytes > phases(3)[StepPhase.OPTIMIZER_STEP].peak_bytes
    assert LayerSampling(40, (2, 3, 10)).combine([phases(2), phases(3), phases(10)]) == _rank(40, 30, 100)
    assert LayerSampling(3, (3,)).combine([phases(3)]) == phases(3)[StepPhase.FORWARD_BACKWARD]


def test_a_line_that_misses_the_peak_at_the_check_depth_asks_for_the_whole_trace():
    """Within one phase a steeper moment takes over between the sampled depths and the check."""

    def steeper_from_ten(depth: int) -> RankMemory:
        return max(_rank(depth, 10, 500), _rank(depth, 30, 320), key=lambda rank: rank.peak_bytes)

    missed = [{StepPhase.FORWARD_BACKWARD: steeper_from_ten(depth)} for depth in (2, 3, 10)]
    assert LayerSampling(40, (2, 3, 10)).combine(missed) is None


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


def test_a_deep_model_is_sampled_and_a_shallow_one_or_a_pipeline_stage_traced_whole():
    one = DistributedSetup.single_process()
    assert layer_sampling(_llama(), _options(), one).traced_depths == (*SAMPLED_DEPTHS, CHECK_DEPTH)
    assert layer_sampling(_llama(TRACED_WHOLE_UP_TO), _options(), one).traced_depths == (TRACED_WHOLE_UP_TO,)
    staged = DistributedSetup.build("fsdp2", 2, pp_size=2)
    assert layer_sampling(_llama(), _options(), staged).traced_depths == (_llama().num_hidden_layers,)


def _options() -> LoadOptions:
    return LoadOptions(seed=0)


def test_the_sampled_prediction_equals_the_whole_trace_on_fsdp2(monkeypatch):
    """Two ranks of fsdp2, no checkpointing: one moment (the loss) holds the peak at every depth."""
    setup, shape = DistributedSetup.build("fsdp2", 2), TrainingShape(batch_size=2, seq_len=128)
    sampled = predict_memory(_llama(), setup, shape)
    monkeypatch.setattr("nemo_wrap.memory.layer_sampling.TRACED_WHOLE_UP_TO", DEEP)
    whole = predict_memory(_llama(), setup, shape)
    assert "traced 4, 5 and 10 of 12" in sampled.traced and "all 12" in whole.traced
    assert [r.peak_bytes for r in sampled.per_rank] == [r.peak_bytes for r in whole.per_rank]


def test_the_sampled_prediction_of_one_process_matches_the_measured_peak(monkeypatch):
    shape = TrainingShape(batch_size=2, seq_len=128)
    predicted = predict_memory(_llama(), DistributedSetup.single_process(), shape).peak_bytes
    monkeypatch.setattr("tests.memory.test_predict_memory._config", lambda tied, fused=False: _llama())
    measured = case_measured_peak(False, "one", 1, shape)
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)
