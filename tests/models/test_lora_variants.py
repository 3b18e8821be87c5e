"""PEFT's LoRA variants users set — DoRA, ``lora_bias``, ``modules_to_save`` — equal to ``PeftModel``.

Each variant's logits equal PEFT over transformers' class with the same adapter values (1e-5, fp32)
in one process, under fsdp2 and under tensor parallel; adapters move both ways; the merged export
is a plain transformers checkpoint with the same logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from nemo_wrap import DistributedSetup, LoadOptions
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import LoraTargetError, UnsupportedLoraOptionError, UnsupportedSaveOptionError
from tests.support.bnb_reference import transformers_4bit
from tests.support.checkpoints import write_checkpoint
from tests.support.steps import train_steps, trainable
from tests.support.tiny_models import tiny_config

IDS = torch.arange(2 * 9).reshape(2, 9) * 7 % 257
VARIANTS = {
    "dora": {"use_dora": True},
    "lora-bias": {"lora_bias": True},
    "modules-to-save": {"modules_to_save": ["lm_head", "embed_tokens", "norm"]},
}


def _config(variant: str, targets="all-linear") -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, **VARIANTS[variant])


def _set_adapters(model) -> None:
    """Distinct non-zero values for what trains (DoRA's magnitudes keep their init), the same for
    the same name on any strategy."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and not name.endswith("magnitude"):
                generator = torch.Generator().manual_seed(sum(map(ord, name)))
                local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                full = torch.randn(parameter.shape, generator=generator) * 0.1
                local.copy_(full if local.shape == full.shape else _local_part(parameter, full))


def _local_part(parameter, full):
    from nemo_wrap.initialization.geometry import shard_geometry

    geometry = shard_geometry(parameter)
    return full[torch.meshgrid(*geometry.dim_indices, indexing="ij")]


def _sgd_steps(model, steps: int = 2) -> list[float]:
    return train_steps(model, torch.optim.SGD(trainable(model), lr=0.1), IDS, steps)


@pytest.fixture(scope="module", params=["own-llama", "own-qwen2", "own-qwen3", "mistral"])
def base(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param) / "base", request.param, "random", tie=False)


# -- one process ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_trained_variant_computes_what_peft_computes_and_comes_back(base, variant, tmp_path):
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_config(variant), seed=0)
    _set_adapters(ours)
    _sgd_steps(ours)
    ours.save_pretrained(tmp_path / "adapter")
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(base), _config(variant))
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == sum(
        p.numel() for p in fresh.parameters() if p.requires_grad
    )
    back = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter", verify=True)
    torch.testing.assert_close(back(IDS).logits, ours(IDS).logits, atol=0, rtol=0)
    assert {n for n, p in back.named_parameters() if p.requires_grad} == {n for n, p in ours.named_parameters() if p.requires_grad}
    if variant == "lora-bias":  # Llama-style layers have no bias to merge into (PEFT refuses too)
        with pytest.raises(UnsupportedSaveOptionError, match="no bias to merge lora_bias into"):
            ours.save_pretrained(tmp_path / "merged", merge_adapters=True)
        return
    ours.save_pretrained(tmp_path / "merged", merge_adapters=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_adapter_peft_trained_with_the_variant_loads_here(base, variant, tmp_path):
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), _config(variant, ["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if parameter.requires_grad:  # magnitudes and saved modules too
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter", verify=True)
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)


def test_new_dora_magnitudes_are_peft_initial_row_norms(base, tmp_path):
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_config("dora"), seed=0)
    ours.save_pretrained(tmp_path / "ours")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), _config("dora")).save_pretrained(tmp_path / "peft")
    saved, theirs = load_file(tmp_path / "ours" / "adapter_model.safetensors"), load_file(tmp_path / "peft" / "adapter_model.safetensors")
    magnitudes = [key for key in theirs if key.endswith("lora_magnitude_vector")]
    assert magnitudes and set(magnitudes) <= set(saved)
    for key in magnitudes:
        torch.testing.assert_close(saved[key], theirs[key], rtol=1e-6, atol=0)
    report = ours.load_report.provenance
    assert all("row norms" in report[n].describe() for n in report if n.endswith("lora_magnitude"))


def test_lora_bias_merges_into_layers_that_have_a_bias(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-qwen2", "random", tie=False)  # q/k/v carry biases
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=_config("lora-bias", ["q_proj", "k_proj", "v_proj"]))
    _set_adapters(ours)
    ours.save_pretrained(tmp_path / "merged", merge_adapters=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(IDS).logits, ours(IDS).logits, atol=1e-5, rtol=0)


TIED_HEAD = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}


def _tied_base(directory, kind: str = "own-llama"):
    return write_checkpoint(directory, kind, "random", tie=True)


@pytest.mark.parametrize("kind", ["own-llama", "mistral"])  # our fused class; transformers' class
def test_a_tied_module_to_save_trains_an_untied_copy_as_peft_does(kind, tmp_path):
    base = _tied_base(tmp_path / "base", kind)
    embedding = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    with pytest.warns(UserWarning, match=r"untied copy.*PEFT's behaviour.*ensure_weight_tying=True"):
        ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=LoraConfig(**TIED_HEAD), verify=True)
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    torch.testing.assert_close(ours.lm_head.weight, embedding, atol=0, rtol=0)  # PEFT's copy starts as the module
    assert ours.load_report.provenance["lm_head.weight"].describe().startswith("model.embed_tokens.weight in model.")
    _sgd_steps(ours)
    assert not torch.equal(ours.lm_head.weight, embedding)
    torch.testing.assert_close(ours.model.embed_tokens.weight, embedding, atol=0, rtol=0)  # frozen with the base
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**TIED_HEAD))
    assert sum(p.numel() for p in trainable(ours)) == sum(p.numel() for p in trainable(fresh))
    ours.save_pretrained(tmp_path / "adapter")
    fresh.save_pretrained(tmp_path / "fresh")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == load_file(tmp_path / "fresh" / "adapter_model.safetensors").keys()
    assert "base_model.model.lm_head.weight" in saved and "base_model.model.model.embed_tokens.weight" not in saved
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)
    with pytest.warns(UserWarning, match="untied copy"):
        back = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter", verify=True)
    torch.testing.assert_close(back(IDS).logits, ours(IDS).logits, atol=0, rtol=0)
    with pytest.raises(UnsupportedSaveOptionError, match="untied copy"):
        ours.save_pretrained(tmp_path / "merged", merge_adapters=True)


@pytest.mark.parametrize("kind", ["own-llama", "mistral"])
def test_an_adapter_peft_trained_with_an_untied_copy_loads_here(kind, tmp_path):
    base = _tied_base(tmp_path / "base", kind)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(**TIED_HEAD))
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if parameter.requires_grad:  # the lm_head copy too
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    with pytest.warns(UserWarning, match="untied copy"):
        ours = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter", verify=True)
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)
    embedding = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    torch.testing.assert_close(ours.model.embed_tokens.weight, embedding, atol=0, rtol=0)
    assert [name for name, p in ours.named_parameters() if p.requires_grad and "lora" not in name] == ["lm_head.weight"]


def test_an_untied_copy_of_a_new_model_starts_as_its_source():
    config = LoraConfig(**{**TIED_HEAD, "modules_to_save": ["embed_tokens"]})  # the source end trains
    with pytest.warns(UserWarning, match=r"\['lm_head.weight'\] stays frozen"):
        ours = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama", tie_word_embeddings=True),
                                                    options=LoadOptions(peft_config=config, seed=0))  # fmt: skip
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    torch.testing.assert_close(ours.lm_head.weight, ours.model.embed_tokens.weight, atol=0, rtol=0)
    assert ours.model.embed_tokens.weight.requires_grad and not ours.lm_head.weight.requires_grad
    assert "a copy of model.embed_tokens.weight" in ours.load_report.provenance["lm_head.weight"].describe()


def test_a_tied_module_to_save_trains_the_tied_weight_with_ensure_weight_tying(tmp_path):
    base = _tied_base(tmp_path / "base")
    config = LoraConfig(**TIED_HEAD, ensure_weight_tying=True)
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=config)
    _sgd_steps(ours)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight and ours.lm_head.weight.requires_grad
    ours.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert torch.equal(saved["base_model.model.lm_head.weight"], saved["base_model.model.model.embed_tokens.weight"])
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)
    back = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=tmp_path / "adapter")  # strict: both keys used
    torch.testing.assert_close(back(IDS).logits, ours(IDS).logits, atol=0, rtol=0)


def test_modules_to_save_that_name_nothing_or_a_fused_projection_are_refused(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    with pytest.raises(LoraTargetError, match="matches no module"):
        NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=LoraConfig(r=4, modules_to_save=["classifier"]))
    with pytest.raises(UnsupportedLoraOptionError, match="part of a fused layer"):
        NeMoAutoModelForCausalLM.from_pretrained(base, peft_config=LoraConfig(r=4, modules_to_save=["q_proj"]))


def test_dora_on_a_4bit_base_is_peft_over_transformers_4bit(tmp_path):
    pytest.importorskip("bitsandbytes")
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, peft_config=_config("dora"))
    _set_adapters(ours)
    _sgd_steps(ours)
    ours.save_pretrained(tmp_path / "adapter")
    reference = transformers_4bit(base, quantization, dtype=torch.float32)
    peft = PeftModel.from_pretrained(reference, tmp_path / "adapter")
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)


# -- several ranks: the same adapters trained the same way, saved whole --------------------------
def _setup(layout: str) -> DistributedSetup:
    world = dist.get_world_size()
    return DistributedSetup.build("fsdp2", world, tp_size=world if layout == "tp" else 1)


def _trained(base: str, variant: str, setup: DistributedSetup | None):
    model = NeMoAutoModelForCausalLM.from_pretrained(base, distributed_setup=setup, peft_config=_config(variant), seed=0)
    _set_adapters(model)
    return model, _sgd_steps(model)


def case_train_variant(base: str, variant: str, layout: str, out: str) -> list[float]:
    model, losses = _trained(base, variant, _setup(layout))
    model.save_pretrained(out)
    return losses


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_variant_trains_on_2_ranks_as_one_process(ranks2, variant, layout, tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    single, expected = _trained(str(base), variant, None)
    single.save_pretrained(tmp_path / "single")
    results = ranks2.run(case_train_variant, str(base), variant, layout, str(tmp_path / "ranks"), timeout=180)
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    saved, reference = load_file(tmp_path / "ranks" / "adapter_model.safetensors"), load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys()
    for key in saved:
        torch.testing.assert_close(saved[key], reference[key], rtol=1e-5, atol=1e-6)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "ranks")
    torch.testing.assert_close(peft(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)


def _trained_untied_copy(base: str, setup: DistributedSetup | None):
    model = NeMoAutoModelForCausalLM.from_pretrained(base, distributed_setup=setup, peft_config=LoraConfig(**TIED_HEAD), seed=0)
    return model, _sgd_steps(model)


def case_train_untied_copy(base: str, layout: str, out: str) -> list[float]:
    model, losses = _trained_untied_copy(base, _setup(layout))
    model.save_pretrained(out)
    return losses


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_an_untied_copy_trains_on_2_ranks_as_one_process(ranks2, layout, tmp_path):
    base = _tied_base(tmp_path / "base")
    with pytest.warns(UserWarning, match="untied copy"):
        single, expected = _trained_untied_copy(str(base), None)
    single.save_pretrained(tmp_path / "single")
    results = ranks2.run(case_train_untied_copy, str(base), layout, str(tmp_path / "ranks"), timeout=180)
    for losses in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    saved, reference = load_file(tmp_path / "ranks" / "adapter_model.safetensors"), load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys()
    assert "base_model.model.lm_head.weight" in saved and "base_model.model.model.embed_tokens.weight" not in saved
    for key in saved:
        torch.testing.assert_close(saved[key], reference[key], rtol=1e-5, atol=1e-6)
