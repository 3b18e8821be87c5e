"""Every causal-LM family transformers loads, we load: 17 families, checkpoints written by transformers.

Per family: one process, fsdp2 on 2 gloo ranks and tp=2 (the plan transformers declares) give
logits equal to transformers' own ``from_pretrained`` of the same checkpoint (fp32, atol 1e-5);
what we save has transformers' key set and reloads in plain transformers to the same logits. Renamed keys
(GPT-NeoX) and per-expert MoE tensors (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V3) go through
transformers' conversion mapping, read shard by shard.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup, ShardingError
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from tests.support.families import FAMILIES, RENAMED, tokens, write_family_checkpoint

ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def _keys(directory) -> set[str]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return set(handle.keys())


def _transformers_logits(directory) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(directory).eval()(tokens()).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_loads_and_saves_like_transformers(family, tmp_path):
    write_family_checkpoint(family, tmp_path / "hf")
    expected = _transformers_logits(tmp_path / "hf")
    model = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "hf", verify=True).eval()
    counts = model.load_report.counts()
    assert counts["initialized"] == counts["missing"] == 0 and model.load_report.verified
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()).logits, expected, atol=ATOL, rtol=0)
    model.save_pretrained(tmp_path / "ours")
    assert _keys(tmp_path / "ours") == _keys(tmp_path / "hf")
    torch.testing.assert_close(_transformers_logits(tmp_path / "ours"), expected, atol=ATOL, rtol=0)


def test_the_plan_names_the_conversion_and_an_unsupported_one_is_refused_before_reading(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from nemo_wrap import UnsupportedModelError

    write_family_checkpoint("mixtral", tmp_path / "mixtral")
    plan = str(NeMoAutoModelForCausalLM.plan(tmp_path / "mixtral"))
    assert "keys: transformers' conversion mapping" in plan and "MergeModulelist+Concatenate" in plan
    # hrm_text's checkpoints fuse gate/up, which transformers splits with Chunk: not a window form here
    config = AutoConfig.for_model("hrm_text", vocab_size=257, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hrm")
    with pytest.raises(UnsupportedModelError, match=r"Chunk\(dim=0\)"):  # the dry run refuses it too
        NeMoAutoModelForCausalLM.plan(tmp_path / "hrm")
    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr("nemo_wrap.checkpoint.safetensors_file.BlockReader.block", no_reads)
    with pytest.raises(UnsupportedModelError, match=r"Chunk\(dim=0\)"):
        NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "hrm")


def test_the_conversion_is_in_the_load_report(tmp_path):
    write_family_checkpoint("mixtral", tmp_path)
    report = NeMoAutoModelForCausalLM.from_pretrained(tmp_path).load_report
    experts = report.provenance["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.transform == "TransformersConversion"
    assert experts.keys == tuple(
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3") for e in range(4)
    )


# -- 2 ranks: fsdp2 and tensor parallel ------------------------------------------------------------
def case_family_under(family: str, directory: str, tp_size: int, save_to: str | None) -> dict:
    setup = DistributedSetup.build("fsdp2", 2, tp_size=tp_size)
    try:
        model = NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup, verify=True).eval()
    except ShardingError as error:
        return {"refused": str(error)}
    with torch.no_grad():
        logits = model(tokens()).logits
    if save_to is not None:
        model.save_pretrained(save_to)
    return {"logits": logits, "verified": model.load_report.verified}


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_on_two_ranks(ranks2, family, tmp_path):
    write_family_checkpoint(family, tmp_path / "hf")
    expected = _transformers_logits(tmp_path / "hf")
    for result in ranks2.run(case_family_under, family, str(tmp_path / "hf"), 1, str(tmp_path / "ours")):
        assert result["verified"] is True
        torch.testing.assert_close(result["logits"], expected, atol=ATOL, rtol=0)
    assert _keys(tmp_path / "ours") == _keys(tmp_path / "hf")
    torch.testing.assert_close(_transformers_logits(tmp_path / "ours"), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_on_two_ranks_from_the_declared_plan(ranks2, family, tmp_path):
    write_family_checkpoint(family, tmp_path / "hf")
    expected = _transformers_logits(tmp_path / "hf")
    for result in ranks2.run(case_family_under, family, str(tmp_path / "hf"), 2, str(tmp_path / "ours")):
        assert result["verified"] is True, result.get("refused")
        torch.testing.assert_close(result["logits"], expected, atol=ATOL, rtol=0)
    assert _keys(tmp_path / "ours") == _keys(tmp_path / "hf")
    torch.testing.assert_close(_transformers_logits(tmp_path / "ours"), expected, atol=ATOL, rtol=0)


def test_declared_entries_without_an_equivalent_are_refused_by_name():
    from transformers import DeepseekV2ForCausalLM, MixtralForCausalLM

    from nemo_wrap.models.declared_plans import DeclaredPlan, TransformersStyle

    experts = DeclaredPlan(MixtralForCausalLM)()["model.layers.*.mlp.experts"]
    assert isinstance(experts, TransformersStyle)
    assert experts.parameters == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    with pytest.raises(ShardingError, match=r"'model.layers.\*.self_attn.kv_a_proj_with_mqa': 'mla_kv_a_proj'"):
        DeclaredPlan(DeepseekV2ForCausalLM)()


# -- every element distinct: each local shard is the transformers parameter's slice --------------
def _write_distinct(family: str, directory) -> dict[str, torch.Tensor]:
    model = write_family_checkpoint(family, directory)
    with torch.no_grad():
        offset = 0.0
        for parameter in model.parameters():
            parameter.copy_(torch.arange(parameter.numel(), dtype=torch.float64).view(parameter.shape) + offset)
            offset += parameter.numel()
    model.save_pretrained(directory)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def case_local_shards_are_slices(directory: str, expected: dict[str, torch.Tensor], tp_size: int) -> dict:
    from nemo_wrap.initialization.geometry import local_shard, shard_geometry

    setup = DistributedSetup.build("fsdp2", 2, tp_size=tp_size)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup)
    wrong = []
    for name, parameter in model.named_parameters():
        geometry = shard_geometry(parameter, name)
        if geometry.is_empty:
            continue
        full = expected[name]
        if not torch.equal(local_shard(parameter), full[torch.meshgrid(*geometry.dim_indices, indexing="ij")]):
            wrong.append(name)
    return {"wrong": wrong, "bytes_read": model.load_report.bytes_read}


@pytest.mark.parametrize(
    ("family", "tp_size"),
    [(RENAMED[0], 1), (RENAMED[0], 2), ("mixtral", 1), ("mixtral", 2)],
    ids=["gpt_neox-fsdp2", "gpt_neox-tp2", "mixtral-fsdp2", "mixtral-tp2"],
)
def test_every_local_shard_is_the_transformers_parameters_slice(ranks2, family, tp_size, tmp_path):
    expected = _write_distinct(family, tmp_path)
    results = ranks2.run(case_local_shards_are_slices, str(tmp_path), expected, tp_size)
    assert all(not r["wrong"] for r in results), [r["wrong"] for r in results]
    if tp_size == 1:  # fsdp2 shards every tensor: every byte is read once, by one rank
        with safe_open(tmp_path / "model.safetensors", "pt") as handle:
            file_bytes = sum(handle.get_tensor(k).numel() * 4 for k in handle.keys())
        assert sum(r["bytes_read"] for r in results) == file_bytes


# -- an MoE family trains under ddp, fsdp2 and tensor parallel as in one process --------------------------------------------
def _batches(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step % 2)
    input_ids = torch.randint(4, 257, (4, 12), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids}


def case_moe_training(directory: str, strategy: str, tp_size: int) -> tuple[list[float], list[float]]:
    import torch.distributed as dist

    from nemo_wrap.training import train_step

    def train(model, rows: slice) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        return [
            train_step(model, optimizer, [{k: v[rows] for k, v in _batches(step).items()}]).loss for step in range(3)
        ]

    reference = train(NeMoAutoModelForCausalLM.from_pretrained(directory), slice(0, 4))
    setup = DistributedSetup.build(strategy, 2, tp_size=tp_size)
    rows = slice(0, 4) if tp_size == 2 else slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)  # tp: one batch
    sharded = train(NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup), rows)
    return reference, sharded


@pytest.mark.parametrize(("strategy", "tp_size"), [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)], ids=["ddp", "fsdp2", "tp2"])
def test_moe_training_matches_one_process(ranks2, strategy, tp_size, tmp_path):
    write_family_checkpoint("mixtral", tmp_path)
    for reference, sharded in ranks2.run(case_moe_training, str(tmp_path), strategy, tp_size):
        assert reference[-1] < reference[0]
        torch.testing.assert_close(torch.tensor(sharded), torch.tensor(reference), rtol=1e-5, atol=0)


# -- FSDP over tensor parallel (2 x 2) -------------------------------------------------------------
def case_two_by_two(directory: str) -> dict:
    setup = DistributedSetup.build("fsdp2", 4, tp_size=2)
    model = NeMoAutoModelForCausalLM.from_pretrained(directory, distributed_setup=setup, verify=True).eval()
    with torch.no_grad():
        return {"logits": model(tokens()).logits, "verified": model.load_report.verified}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fsdp2_over_tensor_parallel_on_four_ranks(ranks4, family, tmp_path):
    """Norms and routers live on the dp sub-mesh, replicated over tp: verify counts each piece once."""
    write_family_checkpoint(family, tmp_path)
    expected = _transformers_logits(tmp_path)
    for result in ranks4.run(case_two_by_two, str(tmp_path)):
        assert result["verified"] is True
        torch.testing.assert_close(result["logits"], expected, atol=ATOL, rtol=0)
