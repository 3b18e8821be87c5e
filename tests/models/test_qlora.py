"""4-bit bases (bitsandbytes NF4/FP4) and QLoRA through the audited pipeline.

The reference is transformers' own 4-bit model of the same checkpoint
(``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``): the same layers quantized,
the same bytes, the same logits; adapters move between it (with plain PEFT) and ours both ways.
Under fsdp2, ddp and HSDP each rank quantizes only its rows, and training equals one process.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import LoadVerificationError, MissingExtraError, MissingWeightsError, UnsupportedQuantizationError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.models.lora import is_lora_parameter
from nemo_wrap.models.quantized import QuantizedLinear
from tests.support.bnb_reference import transformers_4bit
from tests.support.checkpoints import write_checkpoint
from tests.support.steps import train_steps, trainable

pytest.importorskip("bitsandbytes")

IDS = torch.arange(2 * 9).reshape(2, 9) * 7 % 257
KINDS = ("own-llama", "own-qwen2", "own-qwen3", "mistral")


def _nf4(double_quant: bool = True, quant_type: str = "nf4", **kwargs) -> BitsAndBytesConfig:
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=double_quant,
        **kwargs,
    )


def _lora(dora: bool = False) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora)


def _transformers_4bit(base, quantization: BitsAndBytesConfig):
    return transformers_4bit(base, quantization, dtype=torch.float32)


@pytest.fixture(scope="module", params=KINDS)
def base(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param) / "base", request.param, "random", tie=False)


def _quantized_projections(model) -> set[str]:
    """transformers' names of the projections a model holds in 4 bits (ours: a fused layer's parts)."""
    import bitsandbytes as bnb

    names = {name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)}
    adapter = model.state_dict_adapter() if hasattr(model, "state_dict_adapter") else None
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            blocks = adapter.blocks(f"{name}.weight", module.weight_shape)
            names |= {block.hf_key.removesuffix(".weight") for block in blocks}
    return names


# -- one process: transformers' bytes, layers and logits -------------------------------------------
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax-fp32", "double-quant"])
def test_the_4bit_model_is_transformers_4bit_model(base, double_quant):
    quantization = _nf4(double_quant)
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, verify=True)
    reference = _transformers_4bit(base, quantization)
    assert _quantized_projections(ours) == _quantized_projections(reference)  # transformers' rule, lm_head kept
    assert ours.load_report.verified
    for name, module in ours.named_modules():
        if isinstance(module, QuantizedLinear) and name in dict(reference.named_modules()):  # a layer of both
            theirs = reference.get_submodule(name).weight
            assert torch.equal(module.weight_packed.reshape(-1), theirs.reshape(-1))  # bitsandbytes' bytes
            assert torch.equal(module.weight_absmax.reshape(-1), theirs.quant_state.absmax)
            assert ours.load_report.provenance[f"{name}.weight"].describe().endswith(module.describe() + ")")
    torch.testing.assert_close(ours(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)


def test_fp4_and_a_bf16_checkpoint_are_transformers_too(tmp_path):
    base = write_checkpoint(tmp_path / "bf16", "own-llama", "random", tie=False, dtype=torch.bfloat16)
    for quantization in (_nf4(quant_type="fp4"), _nf4(double_quant=False)):
        ours = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, verify=True, dtype="auto")
        reference = transformers_4bit(base, quantization)
        assert ours.model.embed_tokens.weight.dtype == torch.bfloat16  # the rest keeps the checkpoint's dtype
        torch.testing.assert_close(ours(IDS).logits, reference(IDS).logits, atol=0, rtol=0)


def test_a_4bit_model_saves_its_dequantized_weights_for_plain_transformers(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-qwen2", "random", tie=False)
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4())
    ours.save_pretrained(tmp_path / "saved")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")  # no quantization_config: plain weights
    assert saved.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    torch.testing.assert_close(saved(IDS).logits, ours(IDS).logits, atol=1e-5, rtol=0)


def test_the_4bit_layers_take_what_bitsandbytes_takes(tmp_path):
    """Per weight element: 4 bits plus an fp32 absmax per 64 (0.5625 bytes), or an 8-bit absmax
    with double quantization (~0.516 bytes): ≤ 0.3× of a 16-bit weight."""
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    for double_quant, per_element in ((False, 0.5625), (True, 0.5 + 1 / 64)):
        model = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4(double_quant))
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        stored = sum(m.weight_packed.nbytes + m.weight_absmax.nbytes for m in layers)
        elements = sum(m.in_features * m.out_features for m in layers)
        assert stored == per_element * elements
        assert stored / (2 * elements) <= 0.3


# -- QLoRA: adapters portable both ways, merged export, training -----------------------------------
def _train(model, steps: int = 3) -> list[float]:
    return train_steps(model, torch.optim.AdamW(trainable(model), lr=1e-2), IDS, steps)


def _qlora(base, setup: DistributedSetup | None = None, double_quant: bool = True, dora: bool = False):
    model = NeMoAutoModelForCausalLM.from_pretrained(
        base, distributed_setup=setup, quantization_config=_nf4(double_quant), peft_config=_lora(dora), seed=0
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.fill_(0.01)
    return model


def test_a_qlora_adapter_loads_in_plain_peft_over_transformers_4bit_model(base, tmp_path):
    model = _qlora(base)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_parameter(n) and p.dtype == torch.float32 for n, p in trainable.items())
    losses = _train(model)
    assert losses[-1] < losses[0]
    model.save_pretrained(tmp_path / "adapter")
    model.save_pretrained(tmp_path / "merged", merge_adapters=True)
    peft = PeftModel.from_pretrained(_transformers_4bit(base, _nf4()), tmp_path / "adapter")
    torch.testing.assert_close(model(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain, 16/32-bit transformers
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    torch.testing.assert_close(merged(IDS).logits, model(IDS).logits, atol=1e-5, rtol=0)
    back = NeMoAutoModelForCausalLM.from_pretrained(
        base, quantization_config=_nf4(), adapter=tmp_path / "adapter", verify=True
    )
    torch.testing.assert_close(back(IDS).logits, model(IDS).logits, atol=0, rtol=0)


def test_an_adapter_trained_by_peft_on_transformers_4bit_model_loads_here(base, tmp_path):
    peft = get_peft_model(_transformers_4bit(base, _nf4()), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    peft.save_pretrained(tmp_path / "adapter")
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4(), adapter=tmp_path / "adapter")
    torch.testing.assert_close(ours(IDS).logits, peft(IDS).logits, atol=1e-5, rtol=0)


def test_activation_checkpointing_gives_the_same_qlora_step(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    plain, checkpointed = _qlora(base), _qlora(base)
    checkpointed.activation_checkpointing_enable()
    for model in (plain, checkpointed):
        model.train()
        model(IDS, labels=IDS).loss.backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        if a.requires_grad:
            assert torch.equal(a.grad, b.grad), name


# -- verify proves the 4-bit bytes, not the loader's own view of them ------------------------------
def test_verify_catches_a_4bit_layer_that_holds_other_rows(tmp_path, monkeypatch):
    base = write_checkpoint(tmp_path / "base", "mistral", "random", tie=False)
    original = QuantizedLinear.encode_rows

    def shifted(self, values, first):  # rows one place down: a geometry bug in the loader
        original(self, values.roll(1, dims=0), first)

    monkeypatch.setattr(QuantizedLinear, "encode_rows", shifted)
    with pytest.raises(LoadVerificationError, match="q_proj.weight"):
        NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4(), verify=True)


# -- bad input: refused by name, in plan() and at load, before any weight is read ------------------
@pytest.mark.parametrize(
    ("quantization", "match"),
    [
        (BitsAndBytesConfig(load_in_8bit=True), "4 bits only"),
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="int4"), "bnb_4bit_quant_type='int4'"),
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16), "bnb_4bit_quant_storage"),
        (BitsAndBytesConfig(load_in_4bit=True, llm_int8_enable_fp32_cpu_offload=True), "cpu_offload"),
        ({"load_in_4bit": True}, "must be a transformers.BitsAndBytesConfig"),
    ],
    ids=["8-bit", "quant-type", "storage", "offload", "dict"],
)
def test_a_config_we_cannot_honour_is_refused_by_name(tmp_path, quantization, match):
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    with pytest.raises(UnsupportedQuantizationError, match=match):
        NeMoAutoModelForCausalLM.plan(base, quantization_config=quantization)
    with pytest.raises(UnsupportedQuantizationError, match=match):
        NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=quantization)


@pytest.mark.parametrize(
    ("setup", "keywords", "match"),
    [
        (("fsdp2", 2, {"tp_size": 2}), {}, "tp_size=2"),
        (("fsdp2", 4, {"pp_size": 2}), {}, "pp_size=2"),
        (("fsdp2", 2, {"cp_size": 2}), {}, "cp_size=2"),
        (("megatron_fsdp", 2, {}), {}, "strategy='megatron_fsdp'"),
        (None, {"precision": "bf16-mixed"}, "bnb_4bit_compute_dtype"),
        (None, {"compile": True}, "compile=True"),
    ],
    ids=["tp", "pp", "cp", "megatron", "bf16-mixed", "compile"],
)
def test_what_4bit_does_not_compose_with_is_refused_by_name(tmp_path, setup, keywords, match):
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    built = None if setup is None else DistributedSetup.build(setup[0], setup[1], **setup[2])
    with pytest.raises(UnsupportedQuantizationError, match=match):
        NeMoAutoModelForCausalLM.plan(base, distributed_setup=built, quantization_config=_nf4(), **keywords)
    if setup is None:  # a setup of several ranks cannot load in one process; plan() is the same function
        with pytest.raises(UnsupportedQuantizationError, match=match):
            NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4(), **keywords)


def test_layers_that_cannot_be_4bit_are_refused_by_name(tmp_path):
    odd = write_checkpoint(tmp_path / "odd", "mistral", "half", tie=False, intermediate_size=96)
    with pytest.raises(UnsupportedQuantizationError, match=r"down_proj \(in_features=96\)"):
        NeMoAutoModelForCausalLM.from_pretrained(odd, quantization_config=_nf4())
    fused = write_checkpoint(tmp_path / "fused", "own-llama", "half", tie=False)
    with pytest.raises(UnsupportedQuantizationError, match=r"keeps \['model.layers.0.self_attn.q_proj'\]"):
        NeMoAutoModelForCausalLM.from_pretrained(fused, quantization_config=_nf4(llm_int8_skip_modules=["q_proj", "lm_head"]))
    tied = write_checkpoint(tmp_path / "tied", "mistral", "half", tie=True)
    with pytest.raises(UnsupportedQuantizationError, match="lm_head.*tied"):
        NeMoAutoModelForCausalLM.from_pretrained(tied, quantization_config=_nf4(llm_int8_skip_modules=["model.norm"]))
    gpt2 = write_checkpoint(tmp_path / "gpt2", "gpt2", "half", tie=False)
    with pytest.raises(UnsupportedQuantizationError, match="Conv1D"):
        NeMoAutoModelForCausalLM.from_pretrained(gpt2, quantization_config=_nf4())
    with pytest.raises(UnsupportedQuantizationError, match="from_config"):
        config = AutoModelForCausalLM.from_pretrained(fused).config
        NeMoAutoModelForCausalLM.from_config(config, options=LoadOptions(quantization_config=_nf4()))


def test_skip_modules_keep_layers_in_16_bits_as_transformers_does(tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    quantization = _nf4(llm_int8_skip_modules=["lm_head", "down_proj"])
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=quantization)
    reference = _transformers_4bit(base, quantization)
    assert _quantized_projections(ours) == _quantized_projections(reference)
    assert not any("down_proj" in name for name in _quantized_projections(ours))
    torch.testing.assert_close(ours(IDS).logits, reference(IDS).logits, atol=1e-5, rtol=0)


def test_a_4bit_weight_missing_from_the_checkpoint_is_never_initialized(tmp_path):
    base = write_checkpoint(tmp_path / "base", "mistral", "half", tie=False)
    tensors = load_file(base / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    for strict in (True, False):
        with pytest.raises(MissingWeightsError, match="model.layers.1.mlp.up_proj.weight"):
            NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4(), strict=strict)


def test_without_bitsandbytes_the_error_names_the_extra(tmp_path, monkeypatch):
    import importlib

    import nemo_wrap.models.quantized.engine as engine

    real = importlib.import_module

    def no_bitsandbytes(name, *args):
        if name.startswith("bitsandbytes"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(engine.importlib, "import_module", no_bitsandbytes)
    base = write_checkpoint(tmp_path / "base", "own-llama", "half", tie=False)
    with pytest.raises(MissingExtraError, match=r"nemo_wrap\[qlora\]"):
        NeMoAutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4())


# -- several ranks: each rank quantizes its rows; training equals one process ----------------------
def _setup(layout: str) -> DistributedSetup:
    world = dist.get_world_size()
    if layout == "hsdp":
        return DistributedSetup.build("fsdp2", world, dp_replicate_size=2)
    return DistributedSetup.build(layout, world)


def case_qlora_trains(base: str, layout: str, out: str, double_quant: bool, dora: bool = False) -> dict:
    model = _qlora(base, _setup(layout), double_quant, dora)
    local = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            packed = module.weight_packed
            rows = module.local_rows().tolist()
            local[name] = (rows, (packed.to_local() if isinstance(packed, DTensor) else packed).clone())
    verified = NeMoAutoModelForCausalLM.from_pretrained(
        base, distributed_setup=_setup(layout), quantization_config=_nf4(double_quant), verify=True
    ).load_report
    losses = _train(model)
    model.save_pretrained(out)
    model.save_pretrained(out + "-merged", merge_adapters=True)
    return {"losses": losses, "local": local, "verified": verified.verified, "bytes_read": verified.bytes_read}


@pytest.mark.parametrize(
    ("layout", "double_quant", "dora"), [("fsdp2", True, False), ("fsdp2", False, False), ("ddp", True, False), ("fsdp2", True, True)]
)
def test_qlora_on_2_ranks_quantizes_each_rank_rows_and_trains_as_one_process(ranks2, layout, double_quant, dora, tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-qwen2", "random", tie=False)
    single = _qlora(base, double_quant=double_quant, dora=dora)
    whole = {n: m.weight_packed for n, m in single.named_modules() if isinstance(m, QuantizedLinear)}
    expected = _train(single)
    single.save_pretrained(tmp_path / "single")
    out = str(tmp_path / "ranks")
    results = ranks2.run(case_qlora_trains, str(base), layout, out, double_quant, dora, timeout=180)
    for result in results:
        assert result["verified"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        for name, (rows, local) in result["local"].items():  # this rank's rows: exactly bitsandbytes' bytes
            assert torch.equal(local, whole[name][rows])
    total = sum(t.nbytes for t in load_file(base / "model.safetensors").values())
    if layout == "fsdp2":  # each rank read and quantized only its rows: the two halves are the whole
        assert sorted(r for result in results for r in result["local"]["model.layers.0.mlp.down_proj"][0]) == list(range(64))
        assert sum(result["bytes_read"] for result in results) == total
    else:
        assert all(result["bytes_read"] == total for result in results)
    saved, reference = load_file(tmp_path / "ranks" / "adapter_model.safetensors"), load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert saved.keys() == reference.keys()
    for key in saved:
        torch.testing.assert_close(saved[key], reference[key], rtol=1e-5, atol=1e-7)
    peft = PeftModel.from_pretrained(_transformers_4bit(base, _nf4(double_quant)), tmp_path / "ranks")
    torch.testing.assert_close(peft(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ranks-merged")
    torch.testing.assert_close(merged(IDS).logits, single(IDS).logits, atol=1e-5, rtol=0)


def test_qlora_under_hsdp_on_4_ranks_trains_as_one_process(ranks4, tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    expected = _train(_qlora(base))
    results = ranks4.run(case_qlora_trains, str(base), "hsdp", str(tmp_path / "ranks"), True, timeout=240)
    for result in results:
        assert result["verified"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)


def case_qlora_resumes(base: str, directory: str) -> list[float]:
    from nemo_wrap.checkpoint.resume import load_checkpoint, save_checkpoint

    def fresh():
        model = _qlora(base, _setup("fsdp2"))
        return model, torch.optim.AdamW(trainable(model), lr=1e-2)

    model, optimizer = fresh()
    losses = train_steps(model, optimizer, IDS, 2)
    save_checkpoint(directory, model, optimizer, 2)
    model, optimizer = fresh()  # resume into a fresh 4-bit model: adapters and optimizer state as saved
    assert load_checkpoint(directory, model, optimizer) == 2
    return losses + train_steps(model, optimizer, IDS, 1)


def test_a_qlora_run_resumes_from_a_sharded_checkpoint_on_2_ranks(ranks2, tmp_path):
    base = write_checkpoint(tmp_path / "base", "own-llama", "random", tie=False)
    expected = _train(_qlora(base))
    for losses in ranks2.run(case_qlora_resumes, str(base), str(tmp_path / "resume"), timeout=180):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


# -- the real model: QLoRA chat SFT of SmolLM2-135M-Instruct on the bundled chat set ----------------
SFT_STEPS = 8


def case_smollm2_qlora_sft(path: str, output_dir: str) -> list[float]:
    from transformers import AutoTokenizer

    from nemo_wrap.default_model import bundled_chat_set
    from nemo_wrap.recipes import SFTConfig, run_sft
    from nemo_wrap.recipes.config import DataSection, OptimizerSection, TrainingSection

    world = dist.get_world_size() if dist.is_initialized() else 1
    load = LoadOptions(quantization_config=_nf4(), peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    config = SFTConfig(
        output_dir,
        data=DataSection(train=str(bundled_chat_set()), pack=True, max_length=128),
        training=TrainingSection(batch_size=2, steps=SFT_STEPS),
        optimizer=OptimizerSection(lr=1e-3),
        load=load,
    )
    records = run_sft(path, DistributedSetup.build("fsdp2", world), config, AutoTokenizer.from_pretrained(path), lambda _: None)
    return [record["loss"] for record in records if "loss" in record]


def test_qlora_sft_of_smollm2_learns_the_chat_set_on_2_ranks(ranks2, shared_cache, tmp_path):
    """The real model under fsdp2 (one process: ``bench_qlora``'s SFT table, and the tiny models above)."""
    from nemo_wrap.default_model import smollm2_instruct_path

    path = str(smollm2_instruct_path(shared_cache))
    losses = ranks2.run(case_smollm2_qlora_sft, path, str(tmp_path / "ranks"), timeout=600)[0]
    assert len(losses) == SFT_STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, losses  # the "Quack!" answers are learnt
    assert (tmp_path / "ranks" / "adapter_model.safetensors").is_file()
