"""``choose_layout`` / ``plan --auto``: the layouts it weighs, its cost model, and its choice run
for real on gloo ranks: under the budget on every rank, and where nothing fits, the smallest
candidate, run, indeed over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.cli import main
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.memory import Layout, Machine, choose_layout, predict_memory
from nemo_wrap.memory.cost import ModelSizes, step_cost
from nemo_wrap.memory.layouts import candidate_layouts
from nemo_wrap.memory.tracking import second_step_peak
from nemo_wrap.recipes.config_file import Setting, build_recipe
from nemo_wrap.recipes.job import distributed_setup, training_shape
from nemo_wrap.training import train_step
from tests.memory.test_predict_memory import _config as llama_config

MIB = 2**20
MEMORY_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "memory.md"
SEQ_LEN = 128
SIZES = ModelSizes(
    parameters=10**6,
    parameter_bytes=4 * 10**6,
    trainable_bytes=4 * 10**6,
    hidden_size=256,
    kv_size=128,
    layers=4,
    activation_bytes=4,
)


def _config() -> LlamaConfig:
    return llama_config(tied=False)


def test_every_candidate_trains_the_asked_rows_per_step_on_the_machine():
    machine = Machine(nproc_per_node=2, device_memory=MIB, nnodes=2)
    layouts = candidate_layouts(machine, global_batch=8, layers=4, experts=0)
    for layout in layouts:
        data_parallel = machine.world_size // (layout.tp * layout.cp * layout.pp)
        assert layout.micro_batch * layout.accumulation * data_parallel == 8
        assert layout.tp <= machine.nproc_per_node  # no tensor parallel across nodes
        assert layout.accumulation >= layout.pp  # 1F1B: a micro-batch per stage at least
        assert layout.setup(machine.world_size).world_size == 4
    degrees = {layout.degrees for layout in layouts}
    # (strategy, tp, cp, replicas, pp, ep)
    assert degrees == {
        ("ddp", 1, 1, 1, 1, 1),
        ("fsdp2", 1, 1, 1, 1, 1),
        ("fsdp2", 1, 1, 2, 1, 1),  # HSDP: a replica per node
        ("fsdp2", 1, 2, 1, 1, 1),
        ("fsdp2", 1, 4, 1, 1, 1),
        ("fsdp2", 2, 1, 1, 1, 1),
        ("fsdp2", 2, 2, 1, 1, 1),
        ("fsdp2", 1, 1, 1, 2, 1),  # pipelines of 2 and 4 stages
        ("fsdp2", 1, 2, 1, 2, 1),
        ("fsdp2", 2, 1, 1, 2, 1),
        ("fsdp2", 1, 1, 1, 4, 1),
    }
    plain = ("fsdp2", 1, 1, 1, 1, 1)
    assert sum(layout.degrees == plain for layout in layouts) == 2 * 2  # micro-batch 2 or 1, AC or not
    # 4 stages take the 8 rows as 4 or 8 micro-batches, never 2 or 1
    assert {layout.accumulation for layout in layouts if layout.pp == 4} == {4, 8}
    # experts: every degree dividing both the 4 experts and the ranks sharing a batch (dp_shard × tp)
    moe = {layout.degrees for layout in candidate_layouts(machine, global_batch=8, layers=1, experts=4)}
    assert {degrees[5] for degrees in moe if degrees[:5] == plain[:5]} == {1, 2, 4}
    assert {degrees[5] for degrees in moe if degrees[:5] == ("fsdp2", 1, 2, 1, 1)} == {1, 2}
    assert all(degrees[4] == 1 for degrees in moe)  # one layer: no pipeline
    # pipeline stages, and expert parallel inside each stage over the stage's ranks that share a batch
    deep = {layout.degrees for layout in candidate_layouts(machine, 8, layers=4, experts=4)}
    assert {degrees[5] for degrees in deep if degrees[:5] == ("fsdp2", 1, 1, 1, 2)} == {1, 2}
    assert {degrees[5] for degrees in deep if degrees[:5] == ("fsdp2", 1, 1, 1, 4)} == {1}
    # an architecture with a sequence-parallel plan cuts every tensor-parallel layout's stream but a pipeline's
    cut = candidate_layouts(machine, global_batch=8, layers=4, experts=0, sequence_parallel=True)
    assert {layout.degrees for layout in cut} == degrees
    assert all(layout.sequence_parallel == (layout.tp > 1 and layout.pp == 1) for layout in cut)
    assert not any(layout.sequence_parallel for layout in layouts)
    # one rank: what finetune runs there, fsdp2 on a world of one
    assert {layout.degrees for layout in candidate_layouts(Machine(1, MIB), 4, layers=4, experts=0)} == {plain}
    with pytest.raises(InvalidSetupError, match="nproc_per_node"):
        Machine(nproc_per_node=0, device_memory=MIB)


def test_the_cost_model_charges_each_exchange_at_its_link_s_speed():
    one_node = Machine(nproc_per_node=4, device_memory=MIB, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9)
    ddp = step_cost(Layout("ddp", 2, 1), SIZES, one_node, SEQ_LEN)
    assert ddp.parts == (("ddp all-reduce", 2 * 3 / 4 * 4e6 / 100e9),)
    two_nodes = Machine(nproc_per_node=2, device_memory=MIB, nnodes=2, inter_node_bandwidth=10e9)
    assert step_cost(Layout("ddp", 2, 1), SIZES, two_nodes, SEQ_LEN).seconds == pytest.approx(10 * ddp.seconds)
    fsdp = step_cost(Layout("fsdp2", 2, 1), SIZES, one_node, SEQ_LEN).seconds
    accumulated = step_cost(Layout("fsdp2", 1, 2), SIZES, one_node, SEQ_LEN).seconds
    assert fsdp == pytest.approx(3 / 4 * 3 * 4e6 / 100e9) and accumulated == pytest.approx(5 / 3 * fsdp)
    recomputed = step_cost(Layout("fsdp2", 2, 1, activation_checkpointing=True), SIZES, one_node, SEQ_LEN)
    assert dict(recomputed.parts)["recompute"] == pytest.approx(2 * 10**6 * (2 * SEQ_LEN * 4) / 4 / one_node.flops)


def test_the_cost_model_charges_a_pipeline_its_bubble_and_expert_parallel_its_all_to_all():
    node = Machine(nproc_per_node=4, device_memory=MIB, intra_node_bandwidth=100e9)
    # 2 stages, 4 micro-batches of 1 row: 2 fsdp ranks gather half the weights; 1/4 of the arithmetic idle
    staged = dict(step_cost(Layout("fsdp2", 1, 4, pp=2), SIZES, node, SEQ_LEN).parts)
    assert staged["fsdp gather/scatter"] == pytest.approx(1 / 2 * (2 * 4 * 4e6 + 4e6) / 2 / 100e9)
    arithmetic = 6 * 10**6 * (4 * SEQ_LEN * 2) / 4 / node.flops
    assert staged["pp bubble"] == pytest.approx(1 / 4 * arithmetic)
    assert staged["pp send/recv"] == pytest.approx(2 * 4 * SEQ_LEN * 256 * 4 / 100e9)
    moe = ModelSizes(
        **{
            **vars(SIZES),
            "experts": 8,
            "experts_per_token": 2,
            "moe_layers": 4,
            "expert_bytes": 3 * 10**6,
            "expert_trainable_bytes": 3 * 10**6,
        }
    )
    routed = dict(step_cost(Layout("fsdp2", 2, 1, ep=4), moe, node, SEQ_LEN).parts)
    assert routed["ep all-to-all"] == pytest.approx(4 * 4 * 3 / 4 * 2 * SEQ_LEN * 2 * 256 * 4 / 100e9)
    # the dense quarter over 4 ranks; each rank's quarter of the experts whole (efsdp 1: nothing gathered)
    assert routed["fsdp gather/scatter"] == pytest.approx(3 / 4 * (2 * 1e6 + 1e6) / 100e9)
    assert "expert fsdp gather/scatter" not in routed


@pytest.mark.parametrize(
    "layout",
    [
        Layout("fsdp2", 2, 3, activation_checkpointing=True, tp=2),
        Layout("fsdp2", 2, 3, activation_checkpointing=True, tp=2, sequence_parallel=True),
        Layout("fsdp2", 1, 4, pp=2),
        Layout("fsdp2", 2, 1, ep=2),
        Layout("fsdp2", 1, 4, pp=2, ep=2),
    ],
    ids=lambda layout: layout.describe(),
)
def test_the_recipe_fragment_is_the_layout_s_job(layout):
    machine = Machine(nproc_per_node=4, device_memory=MIB)
    settings = [
        Setting(f"{section}.{key}", value, "fragment")
        for section, keys in layout.recipe(machine).items()
        for key, value in keys.items()
    ]
    recipe = build_recipe([*settings, Setting("data.seq_len", SEQ_LEN, "test")])
    assert distributed_setup(recipe, 4) == layout.setup(4)
    assert training_shape(recipe) == layout.shape(SEQ_LEN)


def layout_measured_peak(layout: Layout, world_size: int) -> int:
    """This rank's tensor peak in the second of two real steps of ``layout``."""
    torch.set_num_threads(1)
    model = NeMoAutoModelForCausalLM.from_config(_config(), layout.setup(world_size), options=LoadOptions(seed=0))
    if layout.activation_checkpointing:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = torch.randint(0, 4096, (layout.micro_batch, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": rows}] * layout.accumulation
    return second_step_peak(model, optimizer, batches, lambda given: train_step(model, optimizer, given))["Total"]


def test_the_chosen_layout_run_for_real_stays_under_the_budget_on_every_rank(ranks2):
    # 8 rows of 128 tokens a step on 2 ranks: plain fsdp2 (4 rows a rank) predicts 91.5 MiB
    machine = Machine(nproc_per_node=2, device_memory=80 * MIB)
    choice = choose_layout(_config(), machine, global_batch=8, seq_len=SEQ_LEN)
    plain = predict_memory(_config(), Layout("fsdp2", 4, 1).setup(2), Layout("fsdp2", 4, 1).shape(SEQ_LEN))
    assert plain.peak_bytes > choice.budget  # a budget the plain layout exceeds
    assert choice.chosen is not None and choice.chosen.peak_bytes is not None
    assert choice.fitting == tuple(sorted(choice.fitting, key=lambda c: c.cost.seconds))
    measured = ranks2.run(layout_measured_peak, choice.chosen.layout, 2)
    assert max(measured) <= choice.budget, (choice.chosen.describe(), measured)
    assert "chosen, as a recipe fragment" in str(choice)


def test_when_nothing_fits_it_says_what_the_smallest_layout_needs_and_that_one_is_over(ranks2):
    # the smallest layout predicts 48.7 MiB: the budget is 45 MiB
    machine = Machine(nproc_per_node=2, device_memory=50 * MIB)
    choice = choose_layout(_config(), machine, global_batch=8, seq_len=SEQ_LEN)
    assert choice.chosen is None and choice.smallest is not None
    assert "nothing fits: the smallest" in str(choice)
    measured = ranks2.run(layout_measured_peak, choice.smallest.layout, 2)
    assert max(measured) > choice.budget, (choice.smallest.describe(), measured)


def test_plan_auto_prints_a_fragment_that_finetune_reads(capsys, tmp_path, monkeypatch):
    """The memory guide's command, as shown there; its progress (bars on) on stderr."""
    command = "plan --auto --nproc 2 --batch-size 2 --seq-len 32 --device-memory 1GiB --json"
    assert f"nemo-wrap {command}" in MEMORY_GUIDE.read_text()
    monkeypatch.setenv("NEMO_WRAP_PROGRESS", "1")
    assert main(command.split()) == 0
    printed = capsys.readouterr()
    assert "layouts judged" in printed.err and "dry run of fsdp2" in printed.err
    chosen = json.loads(printed.out)["auto"]["chosen"]
    distributed, training = chosen["distributed"], chosen["training"]
    held_by_one_replica = distributed["tp_size"] * distributed["cp_size"] * distributed.get("pp_size", 1)
    assert distributed["nproc"] == 2
    assert training["batch_size"] * training["accumulation"] * 2 // held_by_one_replica == 2 * 2
    fragment = tmp_path / "layout.yaml"
    fragment.write_text(yaml.safe_dump(chosen))
    assert main(["finetune", "--config", str(fragment), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["distributed"]["nproc"] == 2
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--auto", "--nproc", "2"])
    assert stopped.value.code == 2
    assert "--device-memory" in capsys.readouterr().err
