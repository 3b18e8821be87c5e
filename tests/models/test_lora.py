"""LoRA through the audited pipeline: PEFT's names and numbers, under one process, ddp and fsdp2."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LoraTargetError,
    ShapeMismatchError,
    UnsupportedLoraOptionError,
)
from nemo_wrap.models.lora import is_lora_parameter
from tests.support.checkpoints import write_checkpoint

TARGETS = (["q_proj", "v_proj"], ["k_proj", "o_proj", "down_proj"], "all-linear")
IDS = torch.arange(2 * 9).reshape(2, 9) * 7 % 257


def _lora(targets=("q_proj", "v_proj"), **kwargs) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=list(targets) if not isinstance(targets, str) else targets, **kwargs)


def _set_adapters(model, seed: int = 1) -> None:
    """Distinct non-zero adapter values, the same for the same name on any strategy."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if is_lora_parameter(name):
                generator = torch.Generator().manual_seed(seed + sum(map(ord, name)))
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


@pytest.fixture(scope="module", params=["own-llama", "own-qwen2", "own-qwen3", "mistral"])
def base(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param) / "base", request.param, "distinct", tie=False)


@pytest.mark.parametrize("targets", TARGETS, ids=["q-v", "k-o-down", "all-linear"])
def test_our_fused_class_with_lora_computes_what_peft_on_transformers_computes(base, targets, tmp_path):
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora(targets))
    _set_adapters(ours)
    ours.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    torch.testing.assert_close(ours(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)
    ours.save_pretrained(tmp_path / "merged", merge_adapters=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)
    fresh_peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), _lora(targets))
    trainable = [p.numel() for p in ours.parameters() if p.requires_grad]
    assert sum(trainable) == sum(p.numel() for p in fresh_peft.parameters() if p.requires_grad)
    assert all(is_lora_parameter(n) for n, p in ours.named_parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "config",
    [dict(target_modules="all-linear", exclude_modules=["o_proj", "up_proj"]), dict(target_modules=r".*\.1\.mlp\..*_proj")],
    ids=["all-linear-excluding", "regex"],
)
def test_regex_and_exclude_select_what_peft_selects(tmp_path, config):
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=LoraConfig(r=2, **config))
    ours.save_pretrained(tmp_path / "adapter")
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=2, **config))
    expected = {k.replace(".default", "") for k in peft.state_dict() if "lora_" in k}
    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == expected


def test_rank_stabilized_scaling_matches_peft(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "distinct", tie=False)
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora(use_rslora=True))
    _set_adapters(ours)
    ours.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    assert reference.peft_config["default"].use_rslora
    torch.testing.assert_close(ours(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)


# PEFT's per-module ranks and alphas: a suffix, a regex naming one layer's projection, alphas apart
PATTERNS = {"rank_pattern": {"q_proj": 2, r"layers\.1\.mlp\.down_proj": 6}, "alpha_pattern": {"v_proj": 32, "gate_proj": 3}}


def test_rank_and_alpha_patterns_compute_what_peft_computes(base, tmp_path):
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora("all-linear", **PATTERNS))
    _set_adapters(ours)
    ours.save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    ranks = {n: p.shape[0] for n, p in reference.named_parameters() if n.endswith("lora_A.default.weight")}
    assert {2, 4, 6} <= set(ranks.values())  # the patterns reached PEFT through the saved config
    torch.testing.assert_close(ours(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)
    ours.save_pretrained(tmp_path / "merged", merge_adapters=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)
    fresh_peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), _lora("all-linear", **PATTERNS))
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in fresh_peft.parameters() if p.requires_grad)
    back = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter")  # and back, from PEFT's file
    torch.testing.assert_close(back(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)


def test_a_new_adapter_changes_nothing_and_is_in_the_load_report(base):
    plain = NeMoAutoModelForCausalLM.from_pretrained(base)
    adapted = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora(), seed=0)
    torch.testing.assert_close(adapted(IDS).logits, plain(IDS).logits, atol=0, rtol=0)
    report = adapted.load_report.provenance
    names = [n for n in report if is_lora_parameter(n)]
    assert len(names) == 2 * 2 * 2  # 2 layers × (q, v) × (A, B)
    assert all(report[n].kind == "initialized" and "PEFT's init" in report[n].describe() for n in names)
    a = dict(adapted.named_parameters())[names[0] if names[0].endswith("lora_A") else names[1]]
    assert a.abs().max() > 0 and "LoRA adapters: new" in str(adapted.load_report.plan)


# -- several ranks: the same adapter values, trained the same, saved whole, loadable by PEFT -------
def _train_two_steps(model) -> list[float]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(2):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if not is_lora_parameter(n))  # frozen
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _setup(strategy: str) -> DistributedSetup:
    """``"tp"``: tensor parallel over every rank; ``"2x2"``: fsdp2 over 2 × tp 2, with sequence
    parallel (the adapters' inputs are the blocks' gathered inputs); else the strategy."""
    world = dist.get_world_size()
    if strategy == "tp":
        return DistributedSetup.build("fsdp2", world, tp_size=world)
    if strategy == "2x2":
        return DistributedSetup.build("fsdp2", world, tp_size=2, sequence_parallel=True)
    return DistributedSetup.build(strategy, world)


def _trainable_lora(base, setup: DistributedSetup | None = None, patterns: bool = False):
    """All-linear LoRA, seeded, with a non-zero B so training moves the logits from the first step."""
    config = _lora(TARGETS[2], **(PATTERNS if patterns else {}))
    model = NeMoAutoModelForCausalLM.from_pretrained(base, distributed_setup=setup, peft_config=config, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.fill_(0.01)
    return model


def case_train_and_save_lora(base: str, strategy: str, out: str, patterns: bool = False) -> list[float]:
    model = _trainable_lora(base, _setup(strategy), patterns)
    losses = _train_two_steps(model)
    model.save_pretrained(out)
    model.save_pretrained(out + "-merged", merge_adapters=True)
    return losses


def case_load_adapter(base: str, strategy: str, adapter: str) -> list[float]:
    setup = _setup(strategy)
    model = NeMoAutoModelForCausalLM.from_pretrained(base, distributed_setup=setup, adapter=adapter, verify=True)
    assert all(p.requires_grad == is_lora_parameter(n) for n, p in model.named_parameters())
    return model(IDS).logits[0, :3, :5].tolist()


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp", "tp"])
def test_lora_trains_the_same_on_2_ranks_and_saves_an_adapter_peft_loads(ranks2, base, strategy, tmp_path):
    single = _trainable_lora(base)
    expected_losses = _train_two_steps(single)
    single.save_pretrained(tmp_path / "single")
    losses = ranks2.run(case_train_and_save_lora, str(base), strategy, str(tmp_path / "ranks"), timeout=120)
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    saved, reference = load_file(tmp_path / "ranks" / "adapter_model.safetensors"), load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys()
    for key in saved:  # every element of every lora_A / lora_B: no slice-only save, no A/B swap
        torch.testing.assert_close(saved[key], reference[key], rtol=1e-5, atol=1e-7)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "ranks")
    torch.testing.assert_close(peft(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ranks-merged")
    torch.testing.assert_close(merged(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)
    other = {"fsdp2": "tp", "ddp": "fsdp2", "tp": "ddp"}[strategy]  # back under another strategy
    logits = ranks2.run(case_load_adapter, str(base), other, str(tmp_path / "ranks"), timeout=120)
    for rank_logits in logits:
        torch.testing.assert_close(torch.tensor(rank_logits), peft(IDS).logits[0, :3, :5], atol=1e-5, rtol=0)


def test_lora_on_a_2_by_2_mesh_trains_and_saves_like_one_process(ranks4, tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-qwen3", "distinct", tie=False)
    single = _trainable_lora(base)
    expected_losses = _train_two_steps(single)
    losses = ranks4.run(case_train_and_save_lora, str(base), "2x2", str(tmp_path / "ranks"), timeout=180)
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "ranks")
    torch.testing.assert_close(peft(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["fsdp2", "tp"])
def test_rank_and_alpha_patterns_train_as_one_process_on_2_ranks(ranks2, base, strategy, tmp_path):
    single = _trainable_lora(base, patterns=True)
    expected_losses = _train_two_steps(single)
    losses = ranks2.run(case_train_and_save_lora, str(base), strategy, str(tmp_path / "ranks"), True, timeout=120)
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "ranks")
    torch.testing.assert_close(peft(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)


# -- bad input -------------------------------------------------------------------------------------
def test_lora_bad_input_is_a_clear_error(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    with pytest.raises(LoraTargetError, match="matches no linear layer"):
        NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora(["attention"]))
    with pytest.raises(UnsupportedLoraOptionError, match="init_lora_weights"):
        NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora(init_lora_weights="gaussian"))
    adapted = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora())
    adapted.save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{not json")
    with pytest.raises(CorruptCheckpointError, match="adapter_model.safetensors"):
        NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointNotFoundError, match="adapter_model.safetensors"):
        NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter")
    adapted.save_pretrained(tmp_path / "other-rank")
    config = json.loads((tmp_path / "other-rank" / "adapter_config.json").read_text())
    (tmp_path / "other-rank" / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ShapeMismatchError, match="adapter_model.safetensors"):  # the file's tensors have r=4
        NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "other-rank")


def test_save_checkpoint_resumes_adapters_and_their_optimizer_state(tmp_path):
    from nemo_wrap.checkpoint.resume import load_checkpoint, save_checkpoint

    base = write_checkpoint(tmp_path / "base", "own-llama", "distinct", tie=False)

    def fresh(seed):
        model = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_lora(TARGETS[2]), seed=seed)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, optimizer = fresh(0)
    _train_two_steps(model)  # SGD moves the adapters; AdamW below carries state across the resume
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    save_checkpoint(tmp_path / "resume", model, optimizer, 3)
    resumed, resumed_optimizer = fresh(1)
    assert load_checkpoint(tmp_path / "resume", resumed, resumed_optimizer) == 3
    for run, opt in ((model, optimizer), (resumed, resumed_optimizer)):
        run(IDS, labels=IDS).loss.backward()
        opt.step()
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
