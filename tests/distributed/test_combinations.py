"""The combination table: every row is refused where it is met, with its own error, reason and way
out; and the multi-GPU guide's support matrix is the table's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import BitsAndBytesConfig

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.distributed.combinations import REFUSALS, Feature, Refusal, refusals
from nemo_wrap.distributed.support import support_matrix
from nemo_wrap.errors import UnsupportedSetupError
from nemo_wrap.training import train_step
from tests.support.families import family_config

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "multi-gpu.md"

# How a load asks for each feature: (strategy, DistributedSetup.build degrees, plan() keywords).
LOAD_FEATURES = {
    Feature.TENSOR: (None, {"tp_size": 2}, {}),
    Feature.SEQUENCE: (None, {"tp_size": 2, "sequence_parallel": True}, {}),
    Feature.PIPELINE: (None, {"pp_size": 2}, {}),
    Feature.CONTEXT: (None, {"cp_size": 2}, {}),
    Feature.EXPERT: (None, {"ep_size": 2}, {}),
    Feature.REPLICATED: ("ddp", {}, {}),
    Feature.FLAT_BUFFERS: ("megatron_fsdp", {}, {}),
    Feature.FOUR_BIT: (None, {}, {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}),
    Feature.FROM_CONFIG: (None, {}, {}),  # plan() of a config: there is no checkpoint
    Feature.BF16_MIXED: (None, {}, {"precision": "bf16-mixed"}),
    Feature.COMPILE: (None, {}, {"compile": True}),
}
# What the code refused before the table existed (written out here, so a row dropped from the table fails).
REFUSED_PAIRS = {
    (Feature.EXPERT, Feature.CONTEXT), (Feature.CONTEXT, Feature.PIPELINE),
    (Feature.SEQUENCE, Feature.PIPELINE),
    (Feature.COMPILE, Feature.TENSOR), *((Feature.FOUR_BIT, other) for other in (
        Feature.FROM_CONFIG, Feature.FLAT_BUFFERS, Feature.TENSOR, Feature.PIPELINE, Feature.CONTEXT,
        Feature.EXPERT, Feature.BF16_MIXED, Feature.COMPILE)),
    (Feature.ROUTER_LOSS, Feature.PIPELINE), (Feature.ROUTER_LOSS, Feature.CONTEXT),
    (Feature.DISTILLATION, Feature.PIPELINE), (Feature.DISTILLATION, Feature.CONTEXT),
    (Feature.PREFERENCE, Feature.PIPELINE), (Feature.PREFERENCE, Feature.CONTEXT),
    (Feature.FROZEN_MODEL, Feature.REPLICATED),
}  # fmt: skip
LOAD_ROWS = [row for row in REFUSALS if {row.first, row.second} <= LOAD_FEATURES.keys()]


def _load_request(row: Refusal) -> tuple[DistributedSetup, dict]:
    strategy, degrees, keywords = "fsdp2", {}, {}
    for feature in (row.first, row.second):
        wanted, more_degrees, more_keywords = LOAD_FEATURES[feature]
        strategy = wanted or strategy
        degrees |= more_degrees
        keywords |= more_keywords
    world = 2 * degrees.get("tp_size", 1) * degrees.get("pp_size", 1) * degrees.get("cp_size", 1)
    return DistributedSetup.build(strategy, world, **degrees), keywords


@pytest.mark.parametrize("row", LOAD_ROWS, ids=lambda row: f"{row.first.name}-{row.second.name}")
def test_every_load_row_is_refused_by_plan_with_its_error_and_way_out(row):
    setup, keywords = _load_request(row)
    with pytest.raises(row.error) as refused:
        NeMoAutoModelForCausalLM.plan(family_config("mixtral"), setup, **keywords)
    message = str(refused.value)
    assert "does not compose with" in message and row.reason in message and row.way_out in message


def test_the_table_refuses_every_pair_refused_before():
    assert {(row.first, row.second) for row in REFUSALS} == REFUSED_PAIRS


def test_the_load_rows_cover_the_table_but_what_only_training_meets():
    trained = {Feature.ROUTER_LOSS, Feature.DISTILLATION, Feature.PREFERENCE, Feature.FROZEN_MODEL}
    assert {row for row in REFUSALS if {row.first, row.second} & trained} == set(REFUSALS) - set(LOAD_ROWS)


def test_a_row_holds_unless_its_exception_is_present():
    teacher = {Feature.FROZEN_MODEL, Feature.REPLICATED}
    assert [row.second for row in refusals(teacher)] == [Feature.REPLICATED]
    assert refusals(teacher | {Feature.TENSOR}) == []  # DDP × TP shards the teacher


@pytest.mark.parametrize("degree", ["pp_size", "cp_size"])
def test_train_step_refuses_a_load_balancing_loss_it_cannot_build_before_any_collective(degree):
    config = family_config("mixtral")
    config.output_router_logits = True
    model = NeMoAutoModelForCausalLM.from_config(config, seed=0)
    model.nemo_state.setup = DistributedSetup.build("fsdp2", 4, **{degree: 2})  # checked before any collective
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, 8))}
    with pytest.raises(UnsupportedSetupError, match=f"output_router_logits=True does not compose with {degree}=2"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch])


def test_the_guide_s_support_matrix_is_the_tables():
    shown = re.search(r"<!-- support-matrix:start -->\n(.*?)\n<!-- support-matrix:end -->", GUIDE.read_text(), re.S)
    assert shown is not None and shown.group(1) == support_matrix()
