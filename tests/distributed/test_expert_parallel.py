"""Expert parallel (``ep_size``): whole experts per rank, tokens by all-to-all, as one process computes.

Three MoE families (Mixtral, Qwen3-MoE, OLMoE; on 2 ranks also Qwen2-MoE and DeepSeek-V3) train 3
AdamW steps with the one-process losses on 2 gloo ranks (ep=2; ep=2 × tp=2) and on 4 (ep=2 ×
dp_shard=2, HSDP, tp), each rank's expert tensors holding its run of the checkpoint's experts and
nothing else; a rank reads exactly its shards' bytes; the load-balancing loss is the global batch's;
a save loads in plain transformers with the same logits; bad input is refused by name in ``plan()``
and before any collective.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup, NeMoAutoModelForCausalLM
from nemo_wrap.errors import InvalidSetupError, MissingWeightsError, ShardingError
from nemo_wrap.initialization.geometry import local_shard, shard_geometry
from nemo_wrap.training import train_step
from nemo_wrap.training.router_loss import router_loss_share
from tests.support.families import family_config, write_family_checkpoint
from tests.support.tiny_models import tiny_config

FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
# and, on 2 ranks, families with shared experts beside the routed ones (DeepSeek-V3 also a dense first layer)
SHARED_EXPERT_FAMILIES = ("qwen2_moe", "deepseek_v3")
EXPERTS = 4  # tests/support/families.py: every tiny MoE family has 4 experts per layer


def _batch(step: int, padded: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    input_ids = torch.randint(4, 257, (4, 12), generator=generator)
    mask = torch.ones_like(input_ids)
    if padded:  # a padded row: its tokens count neither in the loss nor in the router statistics
        mask[1, 9:] = 0
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _train(model, rows: slice, steps: int = 3, sgd: bool = False, padded: bool = True) -> list[float]:
    """Losses of ``steps`` AdamW steps; SGD's (``sgd``) also see a gradient's scale, which AdamW's hide."""
    parameters = model.parameters()
    optimizer = torch.optim.SGD(parameters, lr=5.0) if sgd else torch.optim.AdamW(parameters, lr=1e-2, foreach=False)
    return [
        train_step(model, optimizer, [{k: v[rows] for k, v in _batch(s % 2, padded).items()}]).loss
        for s in range(steps)
    ]


def _rows(setup: DistributedSetup) -> slice:
    """This rank's rows of the 4-row batch: dealt over dp (the tp ranks of a dp rank share them)."""
    per = 4 // setup.dp_size
    return slice(setup.dp_rank() * per, (setup.dp_rank() + 1) * per)


# -- bad input: refused by name, in plan() and before any collective -----------------------------------------------
@pytest.mark.parametrize(
    ("config", "world", "ep", "error", "named"),
    [
        ("llama", 2, 2, ShardingError, "ep_size=2: NeMoLlamaForCausalLM (model_type='llama') is a dense model"),
        ("mixtral", 8, 8, ShardingError, "ep_size=8 does not divide the 4 experts of each MoE layer of "
         "NeMoMixtralForCausalLM; choose ep_size from [1, 2, 4]"),
    ],
    ids=["dense-model", "experts-not-divisible"],
)  # fmt: skip
def test_an_ep_size_the_model_cannot_take_is_refused_in_plan_and_at_load(config, world, ep, error, named):
    model_config = tiny_config("llama") if config == "llama" else family_config(config)
    setup = DistributedSetup.build("fsdp2", world, ep_size=ep)
    with pytest.raises(error) as planned:
        NeMoAutoModelForCausalLM.plan(model_config, setup)
    assert named in str(planned.value)
    with pytest.raises(error) as loading:  # no process group exists: refused before any collective
        NeMoAutoModelForCausalLM.from_config(model_config, distributed_setup=setup)
    assert str(loading.value) == str(planned.value)


def test_an_ep_size_not_dividing_the_ranks_is_refused_at_build():
    with pytest.raises(InvalidSetupError, match=r"ep_size=3 does not divide the 4 ranks .* choose ep_size from"):
        DistributedSetup.build("fsdp2", 4, ep_size=3)


def test_adapters_on_experts_are_refused_by_name(tmp_path):
    from peft import LoraConfig

    from nemo_wrap.errors import LoraTargetError

    write_family_checkpoint("mixtral", tmp_path)
    for target in ("experts", "gate_up_proj", "w1"):  # the module, its stacked tensor, a checkpoint name
        with pytest.raises(LoraTargetError, match=f"target_modules={{'{target}'}} matches no linear layer"):
            NeMoAutoModelForCausalLM.from_pretrained(tmp_path, peft_config=LoraConfig(r=2, target_modules=[target]))


def test_the_plan_says_which_experts_each_rank_holds(tmp_path):
    write_family_checkpoint("mixtral", tmp_path)
    text = str(NeMoAutoModelForCausalLM.plan(tmp_path, DistributedSetup.build("fsdp2", 4, ep_size=2)))
    assert "experts: 4 experts per MoE layer (model.layers.*.mlp.experts) over ep=2: ep rank 0: experts 0–1; " \
           "ep rank 1: experts 2–3" in text  # fmt: skip
    assert "FSDP-sharded over efsdp=2" in text and "(expert mesh efsdp=2, ep=2)" in text


# -- the load-balancing loss is transformers' ----------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_the_router_loss_share_of_one_process_is_transformers_load_balancing_loss(family):
    torch.manual_seed(0)
    config = family_config(family)
    config.output_router_logits = True
    model = AutoModelForCausalLM.from_config(config)
    batch = _batch(0)
    outputs = model(**batch)
    expected = model.router_aux_loss_coef * outputs.aux_loss
    assert float(expected.detach()) > 1e-3
    got = router_loss_share(model, outputs.router_logits, batch["attention_mask"], None)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    unmasked = model(input_ids=batch["input_ids"])
    got = router_loss_share(model, unmasked.router_logits, None, None)
    torch.testing.assert_close(got, model.router_aux_loss_coef * unmasked.aux_loss, rtol=1e-6, atol=0)


# -- 2 ranks -------------------------------------------------------------------------------------------------------
def _expert_holdings(model, setup, expected: dict[str, torch.Tensor]) -> dict:
    """Which experts this rank's expert tensors hold, whether every local shard is the checkpoint's
    slice, and the bytes the rank's shards take (what it must read, and all it may)."""
    from nemo_wrap.state_dict import checkpoint_tensors

    wrong, experts, shard_bytes = [], {}, 0
    for name, parameter in checkpoint_tensors(model)[0].items():  # parameters and persistent buffers
        geometry = shard_geometry(parameter, name)
        local = local_shard(parameter)
        shard_bytes += local.numel() * local.element_size()
        if geometry.is_empty:
            continue
        full = expected[name]
        if not torch.equal(local, full[torch.meshgrid(*geometry.dim_indices, indexing="ij")]):
            wrong.append(name)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts[name] = geometry.dim_indices[0].tolist()
    return {"wrong": wrong, "experts": experts, "shard_bytes": shard_bytes}


def case_expert_parallel_training(directory: str, tp_size: int, router_loss: bool, padded: bool = True) -> dict:
    expected = {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(directory).state_dict().items()}
    overrides = {"output_router_logits": True} if router_loss else {}

    def train(model, rows: slice, sgd: bool = False) -> list[float]:
        return _train(model, rows, sgd=sgd, padded=padded)

    reference = train(NeMoAutoModelForCausalLM.from_pretrained(directory, **overrides), slice(0, 4))
    reference_sgd = train(NeMoAutoModelForCausalLM.from_pretrained(directory, **overrides), slice(0, 4), sgd=True)
    setup = DistributedSetup.build("fsdp2", 2, tp_size=tp_size, ep_size=2)

    def load():
        return NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup, verify=True, **overrides)

    model = load()
    holdings = _expert_holdings(model, setup, expected)
    report = model.load_report
    return {
        **holdings,
        "reference": reference,
        "reference_sgd": reference_sgd,
        "sgd": train(load(), _rows(setup), sgd=True),
        "losses": train(model, _rows(setup)),
        "bytes_read": report.bytes_read,
        "verified": report.verified,
        "expert_sources": {n: p.keys for n, p in report.provenance.items() if n in holdings["experts"]},
        "ep_rank": setup.expert_mesh()["ep"].get_local_rank(),
    }


@pytest.mark.parametrize("family", FAMILIES + SHARED_EXPERT_FAMILIES)
@pytest.mark.parametrize("tp_size", [1, 2], ids=["ep2", "ep2xtp2"])
def test_expert_parallel_trains_as_one_process_and_each_rank_holds_its_experts(ranks2, family, tp_size, tmp_path):
    write_family_checkpoint(family, tmp_path)
    padded = family != "deepseek_v3"  # transformers' own tiny DeepSeek-V3 fails on a padded row (shape error)
    results = ranks2.run(case_expert_parallel_training, str(tmp_path), tp_size, False, padded, timeout=240)
    for result in results:
        assert result["wrong"] == [] and result["verified"] is True
        assert result["reference"][-1] < result["reference"][0]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(
            torch.tensor(result["sgd"]), torch.tensor(result["reference_sgd"]), rtol=1e-5, atol=0
        )
        first = 2 * result["ep_rank"]
        assert result["experts"] and all(held == [first, first + 1] for held in result["experts"].values())
        assert result["bytes_read"] == result["shard_bytes"]  # its own shards, no more, no less
        for name, keys in result["expert_sources"].items():  # every per-expert source key is named
            assert len(keys) == (2 if name.endswith("gate_up_proj") else 1) * EXPERTS, (name, keys)
    if tp_size == 2:  # dense tensors are whole or tp-split alike on both ranks: the experts are what differ
        total = {name: t.numel() * 4 for name, t in load_file(tmp_path / "model.safetensors").items()}
        expert_bytes = sum(n for key, n in total.items() if ".experts." in key)
        dense_bytes = sum(total.values()) - expert_bytes
        assert all(r["bytes_read"] < dense_bytes + expert_bytes / 2 + 1 for r in results)


def test_the_load_balancing_loss_is_the_global_batchs_under_expert_parallel(ranks2, tmp_path):
    write_family_checkpoint("mixtral", tmp_path)
    for result in ranks2.run(case_expert_parallel_training, str(tmp_path), 1, True, timeout=240):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-5, atol=0)
    without = ranks2.run(case_expert_parallel_training, str(tmp_path), 1, False, timeout=240)[0]["reference"]
    assert result["reference"][0] - without[0] > 1e-3  # the router loss is there, and it is matched


def case_save_then_plain_transformers(directory: str, target: str) -> dict:
    setup = DistributedSetup.build("fsdp2", 2, ep_size=2)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup)
    _train(model, _rows(setup), steps=1)
    model.save_pretrained(target)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_batch(5)["input_ids"]).logits
    return {"logits": logits}


def test_a_save_under_expert_parallel_loads_in_plain_transformers_with_equal_logits(ranks2, tmp_path):
    write_family_checkpoint("qwen3_moe", tmp_path / "base")
    results = ranks2.run(case_save_then_plain_transformers, str(tmp_path / "base"), str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(saved) == set(load_file(tmp_path / "base" / "model.safetensors"))  # per-expert keys, as transformers
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()(input_ids=_batch(5)["input_ids"]).logits
    for result in results:
        torch.testing.assert_close(result["logits"], plain, atol=1e-5, rtol=0)


def case_missing_expert(directory: str) -> str:
    setup = DistributedSetup.build("fsdp2", 2, ep_size=2)
    try:
        NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup)
    except MissingWeightsError as error:
        return str(error)
    return "loaded"


def test_strict_names_a_missing_expert_on_every_rank(ranks2, tmp_path):
    write_family_checkpoint("mixtral", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del tensors[missing]
    save_file(tensors, tmp_path / "model.safetensors", {"format": "pt"})
    for message in ranks2.run(case_missing_expert, str(tmp_path)):  # rank 0 does not hold expert 3: it raises too
        assert "model.layers.1.mlp.experts.down_proj" in message and missing in message, message


# -- 4 ranks: ep=2 × dp_shard=2, HSDP, tensor parallel, ep=4 ---------------------------------------------------------
LAYOUTS = {  # name → DistributedSetup.build keywords on 4 ranks
    "ep2xdp2": {"ep_size": 2},
    "hsdp": {"ep_size": 2, "dp_replicate_size": 2},
    "ep2xtp2": {"ep_size": 2, "tp_size": 2},
    "ep4": {"ep_size": 4},
    "pp2xep2": {"ep_size": 2, "pp_size": 2, "pp_schedule": "gpipe"},  # each stage's experts over its 2 ranks
}


def case_four_ranks(directory: str, layout: str) -> dict:
    expected = {k: v.float() for k, v in AutoModelForCausalLM.from_pretrained(directory).state_dict().items()}
    reference = _train(NeMoAutoModelForCausalLM.from_pretrained(directory), slice(0, 4))
    reference_sgd = _train(NeMoAutoModelForCausalLM.from_pretrained(directory), slice(0, 4), sgd=True)
    setup = DistributedSetup.build("fsdp2", 4, **LAYOUTS[layout])
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup, verify=True)
    sgd = _train(NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup), _rows(setup), sgd=True)
    mesh = setup.expert_mesh()
    return {
        **_expert_holdings(model, setup, expected),
        "reference": reference,
        "reference_sgd": reference_sgd,
        "sgd": sgd,
        "losses": _train(model, _rows(setup)),
        "bytes_read": model.load_report.bytes_read,
        "verified": model.load_report.verified,
        "ep_rank": mesh["ep"].get_local_rank(),
        "efsdp_rank": mesh["efsdp"].get_local_rank(),
    }


@pytest.mark.parametrize(
    ("family", "layout"), [(f, "ep2xdp2") for f in FAMILIES] + [("mixtral", "hsdp"), ("olmoe", "ep2xtp2"),
                                                                 ("qwen3_moe", "ep4"), ("mixtral", "pp2xep2")],
)  # fmt: skip
def test_four_ranks_train_as_one_process_with_each_rank_holding_its_share_of_its_experts(
    ranks4, family, layout, tmp_path
):
    write_family_checkpoint(family, tmp_path)
    results = ranks4.run(case_four_ranks, str(tmp_path), layout, timeout=300)
    ep = LAYOUTS[layout]["ep_size"]
    per_rank = EXPERTS // ep
    for result in results:
        assert result["wrong"] == [] and result["verified"] is True
        assert result["bytes_read"] == result["shard_bytes"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(result["reference"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(
            torch.tensor(result["sgd"]), torch.tensor(result["reference_sgd"]), rtol=1e-5, atol=0
        )
        run = list(range(result["ep_rank"] * per_rank, (result["ep_rank"] + 1) * per_rank))
        efsdp = 4 // ep // LAYOUTS[layout].get("dp_replicate_size", 1) // LAYOUTS[layout].get("pp_size", 1)
        share = run[result["efsdp_rank"] :: efsdp] if efsdp > 1 else run  # FSDP splits the run over efsdp
        assert result["experts"] and all(held == share for held in result["experts"].values()), result["experts"]
    assert results[0]["reference"][-1] < results[0]["reference"][0]


def test_each_pipeline_stage_of_experts_is_predicted_within_the_goal_of_its_measured_peak(ranks4):
    """Pipeline stages over expert-parallel ranks (1F1B, 2 stages × ep 2): each rank's predicted peak
    within ±10% of the real step's (the dry run routes tokens evenly, the real router does not)."""
    from nemo_wrap import TrainingShape, predict_memory
    from tests.memory.test_predict_memory import _moe_config, _setup, case_measured_peak

    shape = TrainingShape(batch_size=2, seq_len=128, accumulation=2)
    predicted = [rank.peak_bytes for rank in predict_memory(_moe_config(), _setup("pp-ep", 4), shape).per_rank]
    measured = ranks4.run(case_measured_peak, False, "pp-ep", 4, shape, moe=True, timeout=300)
    ratios = [p / m for p, m in zip(predicted, measured, strict=True)]
    assert all(abs(ratio - 1) <= 0.10 for ratio in ratios), (predicted, measured, ratios)


def case_guarantees(directory: str, resume_dir: str) -> dict:
    from peft import LoraConfig

    from nemo_wrap import load_checkpoint, save_checkpoint

    setup = DistributedSetup.build("fsdp2", 4, ep_size=2)

    def load(**options):
        return NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup, **options)

    def optimizer_of(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    def step(model, optimizer, index):
        return train_step(model, optimizer, [{k: v[_rows(setup)] for k, v in _batch(index % 2).items()}]).loss

    model = load()
    optimizer = optimizer_of(model)
    losses = [step(model, optimizer, i) for i in range(2)]
    save_checkpoint(resume_dir, model, optimizer, step=2)
    losses.append(step(model, optimizer, 2))
    resumed = load()
    resumed_optimizer = optimizer_of(resumed)
    result = {"losses": losses, "resumed_step": load_checkpoint(resume_dir, resumed, resumed_optimizer)}
    result["after_resume"] = step(resumed, resumed_optimizer, 2)
    checkpointed = load()
    checkpointed.activation_checkpointing_enable()
    result["checkpointed"] = step(checkpointed, optimizer_of(checkpointed), 0)
    mixed = load(precision="bf16-mixed")
    result["bf16_mixed"] = _train(mixed, _rows(setup))
    lora = load(peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), seed=3)
    result["lora"] = _train(lora, _rows(setup))
    return result


def test_resume_checkpointing_precision_and_lora_on_dense_projections_hold_under_expert_parallel(ranks4, tmp_path):
    from peft import LoraConfig

    write_family_checkpoint("mixtral", tmp_path / "base")
    expected = _train(NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "base"), slice(0, 4))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    expected_lora = _train(NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "base", peft_config=lora, seed=3),
                           slice(0, 4))  # fmt: skip
    results = ranks4.run(case_guarantees, str(tmp_path / "base"), str(tmp_path / "resume"), timeout=300)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert result["resumed_step"] == 2
        assert result["after_resume"] == pytest.approx(result["losses"][2], rel=1e-6)  # resumed = uninterrupted
        assert result["checkpointed"] == result["losses"][0]  # recomputed layers: the same loss bit for bit
        torch.testing.assert_close(torch.tensor(result["bf16_mixed"]), torch.tensor(expected), rtol=2e-2, atol=0)
        torch.testing.assert_close(torch.tensor(result["lora"]), torch.tensor(expected_lora), rtol=1e-5, atol=0)
    assert expected_lora[-1] < expected_lora[0]
