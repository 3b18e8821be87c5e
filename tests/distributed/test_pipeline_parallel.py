"""Pipeline parallel: stages from the spec, each reading only its layers, trained by torch's schedules.

One-process checks of the pure parts (layouts, options, the plan, refusals), then real gloo ranks:
pp=2 on 2 ranks (gpipe and 1F1B; our fused Llama and Qwen3, transformers' Mistral, tied
embeddings), pp × dp_shard, pp × tp and pp × HSDP on 4 ranks, LoRA with its PEFT adapter, and DCP
resume — losses of 3 AdamW steps equal to one process, saves that plain transformers/PEFT read.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup, InvalidSetupError
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.distributed.pipeline import PipelineOptions, stage_layouts
from nemo_wrap.errors import (
    MissingWeightsError,
    PipelineUsageError,
    UnexpectedKeysError,
    UnsupportedLoraOptionError,
    UnsupportedModelError,
)
from nemo_wrap.state_dict import checkpoint_tensors
from nemo_wrap.training import evaluate, train_step
from tests.support.batches import local_micro_batches
from tests.support.checkpoints import write_checkpoint
from tests.support.shards import local_bytes
from tests.support.tiny_models import tiny_config

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


# -- pure data, one process --------------------------------------------------------------------
def test_layers_are_split_balanced_or_as_given():
    balanced = stage_layouts(7, 3, None, tied_embeddings=False)
    assert [(s.layers.start, s.layers.stop) for s in balanced] == [(0, 3), (3, 5), (5, 7)]
    assert [(s.holds_embedding, s.is_last, s.holds_head) for s in balanced] == [
        (True, False, False),
        (False, False, False),
        (False, True, True),
    ]
    given = stage_layouts(4, 2, (3, 1), tied_embeddings=True)
    assert [(s.layers.start, s.layers.stop) for s in given] == [(0, 3), (3, 4)]
    assert all(s.holds_embedding and s.holds_head for s in given)  # the tied tensor on both ends


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: stage_layouts(2, 3, None, False), "pp_size=3 is larger than the model's 2 decoder layers"),
        (lambda: stage_layouts(4, 2, (1, 2), False), "pp_layer_split=[1, 2] covers 3 decoder layers"),
        (lambda: PipelineOptions("zigzag").check(2), "unknown pp_schedule='zigzag'"),
        (lambda: PipelineOptions("interleaved_1f1b").check(2), "runs several stages per rank"),
        (lambda: PipelineOptions("1f1b", (1, 1, 1)).check(2), "must hold pp_size=2 positive"),
        (lambda: PipelineOptions("1f1b", (2, 0)).check(2), "must hold pp_size=2 positive"),
        (lambda: PipelineOptions("gpipe", (2,)).check(1), "needs pp_size > 1"),
    ],
)
def test_bad_pipeline_input_names_the_value(call, named):
    with pytest.raises(InvalidSetupError) as excinfo:
        call()
    assert named in str(excinfo.value)


def test_plan_prints_each_stage_and_refuses_a_split_that_does_not_cover_the_layers():
    setup = DistributedSetup.build("fsdp2", 4, pp_size=2, pp_schedule="gpipe", pp_layer_split=[3, 1])
    text = str(NeMoAutoModelForCausalLM.plan(tiny_config("own-llama", num_hidden_layers=4), setup))
    for line in (
        "keep this rank's pipeline stage",
        "pipeline schedule gpipe",
        "layers per stage [3, 1]",
        "pipeline stage 0: layers 0–2 + embedding",
        "pipeline stage 1: layers 3–3 + final norm, lm_head",
    ):
        assert line in text
    with pytest.raises(
        InvalidSetupError, match=r"pp_layer_split=\[3, 1\] covers 4 decoder layers, but the model has 2"
    ):
        NeMoAutoModelForCausalLM.plan(tiny_config("own-llama"), setup)
    with pytest.raises(InvalidSetupError, match="pp_size=4 is larger than the model's 2 decoder layers"):
        NeMoAutoModelForCausalLM.from_config(
            tiny_config("llama"), distributed_setup=DistributedSetup.build("fsdp2", 4, pp_size=4)
        )


def test_a_family_that_rescales_inputs_embeds_is_refused_by_name():
    from transformers import GraniteConfig

    config = GraniteConfig(
        **{
            k: v
            for k, v in tiny_config("llama").to_dict().items()
            if k
            in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        }
    )
    with pytest.raises(UnsupportedModelError, match=r"model_type='granite'.*rescales inputs_embeds"):
        NeMoAutoModelForCausalLM.plan(config, DistributedSetup.build("fsdp2", 2, pp_size=2))


def test_only_fsdp2_takes_pipeline_stages():
    with pytest.raises(InvalidSetupError, match="does not take pp_size"):
        DistributedSetup.build("ddp", 2, pp_size=2)


# -- 2 gloo ranks: pp = 2 ----------------------------------------------------------------------
KINDS = {  # name: (tiny kind, tied embeddings)
    "fused-llama": ("own-llama", False),
    "fused-qwen3": ("own-qwen3", False),
    "fallback-mistral": ("mistral", False),
    "tied-fused-llama": ("own-llama", True),
}


def _optimizer(model):
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01, foreach=False
    )


def _train(model, dp_rank: int, dp_size: int, steps: int = 3, micro: int | None = None) -> list[float]:
    """3 AdamW steps over the global batch of 4 rows, one row per micro-batch (4 micro-batches, or
    2 per data-parallel rank)."""
    micro = micro or 4 // dp_size
    optimizer = _optimizer(model)
    batches = [local_micro_batches(step, dp_rank, dp_size, micro) for step in range(steps)]
    return [train_step(model, optimizer, micro_batches, max_grad_norm=1.0).loss for micro_batches in batches]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _stage_bytes(model, checkpoint: str) -> int:
    """The checkpoint bytes of the tensors this stage holds (its share of the file)."""
    with safe_open(f"{checkpoint}/model.safetensors", "pt") as handle:
        sizes = {key: handle.get_slice(key).get_shape() for key in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    report = model.load_report
    return sum(
        4 * int(torch.tensor(sizes[key]).prod())
        for name in report.names("checkpoint")
        for key in report.provenance[name].keys
    )


def case_stage(checkpoint: str, output: str, schedule: str, degrees: dict) -> dict:
    world = dist.get_world_size()
    setup = DistributedSetup.build("fsdp2", world, pp_size=2, pp_schedule=schedule, **degrees)
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, verify=True)
    report = model.load_report
    result = {"stage": setup.pp_rank(), "verified": report.verified, "names": sorted(report.provenance)}
    result["read"], result["share"], result["local"] = (
        report.bytes_read,
        _stage_bytes(model, checkpoint),
        local_bytes(model),
    )
    result["keys"] = sorted({key for name in report.names("checkpoint") for key in report.provenance[name].keys})
    result["losses"] = _train(model, setup.dp_rank(), setup.dp_size)
    result["eval"] = evaluate(model, local_micro_batches(0, setup.dp_rank(), setup.dp_size, 2))
    embedding = getattr(model.get_input_embeddings(), "weight", None)  # a stand-in has none
    result["embedding"] = None if embedding is None else _full(embedding)
    head = getattr(model.get_output_embeddings(), "weight", None)
    result["head"] = None if head is None else _full(head)
    for call in (lambda: model(input_ids=PROMPT), lambda: model.generate(PROMPT, max_new_tokens=2)):
        with pytest.raises(PipelineUsageError, match=r"train with nemo_wrap\.train_step"):
            call()
    if schedule == "1f1b":
        with pytest.raises(InvalidSetupError, match=r"1 micro-batch.*1F1B needs at least 2"):
            train_step(model, _optimizer(model), local_micro_batches(0, setup.dp_rank(), setup.dp_size, 4)[:1])
    result["trained"] = {name: _full(t) for name, t in checkpoint_tensors(model)[0].items()}
    model.save_pretrained(output)
    return result


def _trained_logits(checkpoint, results: list[dict]) -> torch.Tensor:
    """The logits of the model the stages trained: their tensors put together in one process."""
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint)
    trained = {name: t for result in results for name, t in result["trained"].items()}
    missing, unexpected = model.load_state_dict(trained, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # a tied head is the embedding
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(PROMPT).logits


def _reference(checkpoint) -> tuple[list[float], float, torch.Tensor]:
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint)
    losses = _train(model, 0, 1)
    held_out = evaluate(model, local_micro_batches(0, 0, 1, 2))
    with torch.no_grad():
        return losses, held_out, model.eval()(PROMPT).logits


def _check_stages(results: list[dict], checkpoint, output, tied: bool) -> None:
    losses, held_out, logits = _reference(checkpoint)
    assert losses[2] < losses[0] - 0.01, "the reference must learn (step 2 repeats batch 0)"
    with safe_open(f"{checkpoint}/model.safetensors", "pt") as handle:
        keys = set(handle.keys())
    by_stage: dict[int, set[str]] = {}
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        assert result["eval"] == pytest.approx(held_out, rel=1e-5)
        assert result["verified"] is True
        assert result["read"] == result["local"]  # each rank read its own slices of its stage's tensors
        if len(results) == 2:  # one rank per stage: it read its stage's share of the file
            assert abs(result["read"] - result["share"]) <= 0.1 * result["share"]
        by_stage.setdefault(result["stage"], set()).update(result["keys"])
    first, last = by_stage[0], by_stage[1]
    assert first | last == keys  # the union over stages is the checkpoint (their report's source keys)
    assert not any(".layers.1." in name for name in first) and not any(".layers.0." in name for name in last)
    assert (first & last) == ({"model.embed_tokens.weight"} if tied else set())
    if tied:  # the two copies stayed bit-identical through 3 steps
        stage0 = next(r for r in results if r["stage"] == 0)
        stage1 = next(r for r in results if r["stage"] == 1)
        assert torch.equal(stage0["embedding"], stage1["embedding"]) and torch.equal(
            stage1["head"], stage1["embedding"]
        )
    saved = AutoModelForCausalLM.from_pretrained(output).eval()
    with safe_open(f"{output}/model.safetensors", "pt") as handle:
        assert ("lm_head.weight" in set(handle.keys())) is not tied  # one tensor for a tied pair
    with torch.no_grad():
        torch.testing.assert_close(saved(PROMPT).logits, _trained_logits(checkpoint, results), atol=1e-5, rtol=0)
        # AdamW turns last-bit gradient differences on rarely seen embedding rows into 1e-4-sized steps
        torch.testing.assert_close(saved(PROMPT).logits, logits, atol=1e-3, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_two_stages_train_as_one_process(ranks2, tmp_path, kind, schedule):
    tiny, tied = KINDS[kind]
    checkpoint = write_checkpoint(tmp_path / "ckpt", tiny, "random", tie=tied)
    results = ranks2.run(case_stage, str(checkpoint), str(tmp_path / "out"), schedule, {}, timeout=120)
    _check_stages(results, checkpoint, tmp_path / "out", tied)


# -- 4 gloo ranks: pp = 2 with dp_shard, tp, HSDP ------------------------------------------------
@pytest.mark.parametrize(
    ("degrees", "kind"),
    [
        ({}, "tied-fused-llama"),
        ({"tp_size": 2}, "fused-llama"),
        ({"tp_size": 2}, "tied-fused-llama"),
        ({"dp_replicate_size": 2}, "fallback-mistral"),
    ],
    ids=["pp-dp_shard", "pp-tp", "pp-tp-tied", "pp-hsdp"],
)
def test_stages_compose_with_fsdp_and_tensor_parallel(ranks4, tmp_path, degrees, kind):
    tiny, tied = KINDS[kind]
    checkpoint = write_checkpoint(tmp_path / "ckpt", tiny, "random", tie=tied)
    results = ranks4.run(case_stage, str(checkpoint), str(tmp_path / "out"), "1f1b", degrees, timeout=180)
    _check_stages(results, checkpoint, tmp_path / "out", tied)


# -- LoRA, resume, activation checkpointing, precision under pp = 2 -------------------------------
def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def case_lora_and_resume(checkpoint: str, adapter: str, resume_dir: str) -> dict:
    from nemo_wrap import load_checkpoint, save_checkpoint

    setup = DistributedSetup.build("fsdp2", 2, pp_size=2)

    def load(**options):
        return NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, seed=1, **options)

    def batch(step):
        return local_micro_batches(step, 0, 1, 2)

    result = {}
    lora = load(peft_config=_lora())
    result["lora"] = _train(lora, 0, 1, micro=2)
    result["lora_names"] = sorted(name for name, p in lora.named_parameters() if p.requires_grad)
    lora.save_pretrained(adapter)
    model, optimizer = load(), None
    optimizer = _optimizer(model)
    steps = [train_step(model, optimizer, batch(step)).loss for step in range(2)]
    save_checkpoint(resume_dir, model, optimizer, step=2)
    result["uninterrupted"] = train_step(model, optimizer, batch(2)).loss
    resumed = load()
    resumed_optimizer = _optimizer(resumed)
    result["resumed_step"] = load_checkpoint(resume_dir, resumed, resumed_optimizer)
    result["after_resume"], result["first"] = train_step(resumed, resumed_optimizer, batch(2)).loss, steps
    checkpointed = load()
    checkpointed.activation_checkpointing_enable()
    result["checkpointed"] = _train(checkpointed, 0, 1, steps=1, micro=2)
    mixed = load(precision="bf16-mixed")
    result["bf16_mixed"] = _train(mixed, 0, 1, micro=2)
    fresh = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), distributed_setup=setup, seed=5)
    result["fresh"] = {name: _full(t) for name, t in checkpoint_tensors(fresh)[0].items()}
    return result


def test_lora_resume_checkpointing_and_precision_under_two_stages(ranks2, tmp_path):
    from peft import PeftModel

    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "random", tie=True)
    results = ranks2.run(case_lora_and_resume, str(checkpoint), str(tmp_path / "adapter"), str(tmp_path / "dcp"))
    reference = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, peft_config=_lora(), seed=1)
    lora_losses = _train(reference, 0, 1, micro=2)
    plain = NeMoAutoModelForCausalLM.from_pretrained(checkpoint)
    plain_losses = _train(plain, 0, 1, steps=1, micro=2)
    mixed = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, precision="bf16-mixed")
    mixed_losses = _train(mixed, 0, 1, micro=2)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["lora"]), torch.tensor(lora_losses), rtol=1e-5, atol=0)
        assert all("lora_" in name for name in result["lora_names"])
        assert result["resumed_step"] == 2 and result["after_resume"] == result["uninterrupted"]
        assert result["checkpointed"] == pytest.approx(plain_losses, rel=1e-5)
        torch.testing.assert_close(torch.tensor(result["bf16_mixed"]), torch.tensor(mixed_losses), rtol=1e-2, atol=0)
    fresh = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), seed=5).state_dict()
    for result in results:  # each stage initialized its own tensors as one process does, padding row included
        assert result["fresh"] and all(torch.equal(t, fresh[name]) for name, t in result["fresh"].items())
    assert not fresh["model.embed_tokens.weight"][3].any()
    stage_names = [set(r["lora_names"]) for r in results]
    assert not stage_names[0] & stage_names[1]  # each stage adapts its own layers
    base = AutoModelForCausalLM.from_pretrained(checkpoint)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(PROMPT).logits, reference.eval()(PROMPT).logits, atol=1e-5, rtol=0)


def case_untied_copy(checkpoint: str) -> str:
    from peft import LoraConfig

    setup = DistributedSetup.build("fsdp2", 2, pp_size=2)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])
    try:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, peft_config=config)
    except UnsupportedLoraOptionError as error:
        return str(error)
    return "loaded"


def test_an_untied_copy_of_the_tied_embedding_is_refused_on_every_stage(ranks2, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "random", tie=True)
    for outcome in ranks2.run(case_untied_copy, str(checkpoint)):  # stage 0 holds no lm_head, and raises too
        assert "pipeline stages" in outcome and "ensure_weight_tying=True" in outcome, outcome


def case_strict(checkpoint: str) -> str:
    setup = DistributedSetup.build("fsdp2", 2, pp_size=2)
    try:
        NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup)
    except (MissingWeightsError, UnexpectedKeysError) as error:
        return f"{type(error).__name__}: {error}"
    return "loaded"


@pytest.mark.parametrize(
    ("change", "raised"),
    [("drop", "MissingWeightsError: .*'model.layers.1.mlp.down_proj.weight'"),
     ("add", "UnexpectedKeysError: .*'model.layers.7.mlp.down_proj.weight'")],
)
def test_strict_covers_the_whole_model_on_every_stage(ranks2, tmp_path, change, raised):
    from safetensors.torch import load_file, save_file

    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "random", tie=False)
    tensors = load_file(checkpoint / "model.safetensors")
    if change == "drop":  # a tensor only stage 1 would read
        del tensors["model.layers.1.mlp.down_proj.weight"]
    else:  # a key no stage claims
        tensors["model.layers.7.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].clone()
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    for outcome in ranks2.run(case_strict, str(checkpoint)):  # stage 0 holds neither, and raises too
        assert re.match(raised, outcome), outcome
