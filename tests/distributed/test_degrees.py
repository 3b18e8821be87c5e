"""Parallelism as degrees on one mesh: validation, description, and HSDP / HSDP × TP / DDP × TP on
4 real gloo ranks against one process (every parameter equals the checkpoint, the losses of 3
AdamW steps, the consolidated save, verify, LoRA)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from nemo_wrap import DistributedSetup, InvalidSetupError
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import UnsupportedSetupError
from nemo_wrap.training import train_step
from tests.support.batches import local_micro_batches
from tests.support.checkpoints import write_checkpoint
from tests.support.families import family_config
from tests.support.shards import local_bytes
from tests.support.tiny_models import tiny_config


# -- pure data, one process --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("degrees", "shape", "names", "dp", "shards"),
    [
        (dict(world_size=16, tp_size=2, dp_replicate_size=2), (2, 4, 2), ("dp_replicate", "dp_shard", "tp"), 8, 8),
        (dict(world_size=4, dp_replicate_size=2), (2, 2, 1), ("dp_replicate", "dp_shard", "tp"), 4, 2),
        (dict(world_size=4, tp_size=2, dp_replicate_size=2), (2, 1, 2), ("dp_replicate", "dp_shard", "tp"), 2, 2),
        (dict(world_size=16, tp_size=2, cp_size=2, pp_size=2), (2, 2, 2, 2), ("pp", "dp", "cp", "tp"), 2, 8),
        (dict(world_size=8, ep_size=4), (8, 1), ("dp", "tp"), 8, 8),
    ],
)
def test_degrees_make_one_mesh_in_a_fixed_order(degrees, shape, names, dp, shards):
    setup = DistributedSetup.build("fsdp2", **degrees)
    assert (setup.mesh_shape, setup.mesh_dim_names) == (shape, names)
    assert setup.dp_size == dp and setup.parameter_shards == shards


def test_ddp_takes_tensor_parallel_and_its_replicas_are_the_data_parallel_degree():
    setup = DistributedSetup.build("ddp", 4, tp_size=2)
    assert (setup.mesh_shape, setup.mesh_dim_names, setup.dp_size) == ((2, 2), ("dp", "tp"), 2)
    assert "tensor parallel over tp=2" in setup.describe()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(strategy="fsdp2", world_size=6, tp_size=2, dp_replicate_size=2), "dp_replicate_size=2 · tp_size=2 (= 4)"),
        (dict(strategy="fsdp2", world_size=8, pp_size=3), "multiple of 3"),
        (dict(strategy="ddp", world_size=4, dp_replicate_size=2), "does not take dp_replicate_size"),
        (dict(strategy="ddp", world_size=4, cp_size=2), "it takes: tp_size"),
        (dict(strategy="megatron_fsdp", world_size=4, ep_size=2), "does not take ep_size"),
        (dict(strategy="fsdp2", world_size=4, ep_size=3), "choose ep_size from [1, 2, 4]"),
        (dict(strategy="fsdp2", world_size=4, cp_size=0), "cp_size must be a positive int"),
        (dict(strategy="fsdp2", world_size=4, pp_size=2.0), "pp_size must be a positive int"),
        (dict(strategy="fsdp2", world_size=4, dp_replicate_size=True), "dp_replicate_size must be a positive int"),
    ],
)
def test_bad_degrees_name_the_argument(kwargs, named):
    with pytest.raises(InvalidSetupError) as excinfo:
        DistributedSetup.build(**kwargs)
    assert named in str(excinfo.value)


def test_every_degree_is_planned_and_unbuilt_combinations_are_refused_in_plan_and_load():
    text = str(NeMoAutoModelForCausalLM.plan(tiny_config("llama"), DistributedSetup.build("fsdp2", 16, tp_size=2, cp_size=2)))
    for line in ("mesh (dp=4, cp=2, tp=2)", "context parallel over cp=2", "tensor parallel over tp=2"):
        assert line in text
    text = str(NeMoAutoModelForCausalLM.plan(tiny_config("llama"), DistributedSetup.build("fsdp2", 8, pp_size=2, tp_size=2)))
    assert "mesh (pp=2, dp=2, tp=2)" in text and "pipeline parallel over pp=2" in text
    mixtral = family_config("mixtral")
    text = str(NeMoAutoModelForCausalLM.plan(mixtral, DistributedSetup.build("fsdp2", 8, tp_size=2, ep_size=4)))
    assert "expert parallel over ep=4 of the dp_shard × cp × tp ranks (expert mesh efsdp=2, ep=4)" in text
    text = str(NeMoAutoModelForCausalLM.plan(mixtral, DistributedSetup.build("fsdp2", 8, pp_size=2, ep_size=2)))
    assert "(expert mesh pp=2, efsdp=2, ep=2)" in text  # each stage's experts over its own 4 ranks
    setup = DistributedSetup.build("fsdp2", 8, ep_size=2, cp_size=2)
    with pytest.raises(UnsupportedSetupError, match="ep_size=2 does not compose with cp_size=2"):
        NeMoAutoModelForCausalLM.plan(mixtral, setup)
    with pytest.raises(UnsupportedSetupError, match="ep_size=2 does not compose with cp_size=2"):
        NeMoAutoModelForCausalLM.from_config(mixtral, distributed_setup=setup)


def test_cli_plan_prints_every_degree(capsys):
    from nemo_wrap.cli import main

    assert main(["plan", "--nproc", "16", "--tp-size", "2", "--dp-replicate-size", "2"]) == 0
    shown = capsys.readouterr().out
    assert "mesh (dp_replicate=2, dp_shard=4, tp=2)" in shown and "HSDP" in shown
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--nproc", "6", "--tp-size", "2", "--dp-replicate-size", "2"])
    assert exit_info.value.code == 2
    assert "dp_replicate_size=2 · tp_size=2" in capsys.readouterr().err


def test_registries_refuse_a_name_already_taken():
    from nemo_wrap import MODEL_ARCH_MAPPING, register_architecture
    from nemo_wrap.distributed.strategies import register_strategy, strategy_entry
    from nemo_wrap.errors import DuplicateRegistrationError

    with pytest.raises(DuplicateRegistrationError, match="'fsdp2' is already registered"):
        register_strategy(strategy_entry("fsdp2"))
    ours = next(spec for spec in MODEL_ARCH_MAPPING if "LlamaForCausalLM" in spec.architectures and spec.is_custom)
    before = list(MODEL_ARCH_MAPPING)
    with pytest.raises(DuplicateRegistrationError, match="LlamaForCausalLM is already served"):
        register_architecture(ours)
    assert MODEL_ARCH_MAPPING == before


# -- 4 gloo ranks ---------------------------------------------------------------------------
LAYOUTS = {  # name: (strategy, tp_size, dp_replicate_size)
    "hsdp": ("fsdp2", 1, 2),
    "hsdp-tp": ("fsdp2", 2, 2),
    "ddp-tp": ("ddp", 2, 1),
}
KINDS = {"fused": "own-llama", "fallback": "mistral"}
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _train(model, dp_rank: int, dp_size: int, steps: int) -> list[float]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01, foreach=False)
    return [train_step(model, optimizer, local_micro_batches(step, dp_rank, dp_size, 1)).loss for step in range(steps)]


def case_layout(checkpoint: str, output: str, layout: str, lora: bool) -> dict:
    from peft import LoraConfig

    strategy, tp, replicate = LAYOUTS[layout]
    setup = DistributedSetup.build(strategy, 4, tp_size=tp, dp_replicate_size=replicate)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    model = NeMoAutoModelForCausalLM.from_pretrained(
        checkpoint, distributed_setup=setup, verify=True, peft_config=peft_config, seed=3
    )
    loaded = {name: _full(tensor) for name, tensor in model.state_dict().items()}
    result = {"loaded": loaded, "verified": model.load_report.verified, "bytes_read": model.load_report.bytes_read}
    result["local_bytes"] = local_bytes(model)
    result["losses"] = _train(model, setup.dp_rank(), setup.dp_size, steps=3)
    model.save_pretrained(output)  # every rank: consolidated on rank 0
    with torch.no_grad():
        result["logits"] = _full(model.eval()(PROMPT).logits)
    return result


def _reference(checkpoint, lora: bool) -> dict:
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, peft_config=peft_config, seed=3)
    loaded = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return {"loaded": loaded, "losses": _train(model, 0, 1, steps=3)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_layout_loads_trains_and_saves_as_one_process(ranks4, tmp_path, kind, layout):
    checkpoint = write_checkpoint(tmp_path / "ckpt", KINDS[kind], "distinct", tie=kind == "fused")
    expected = _reference(checkpoint, lora=False)
    results = ranks4.run(case_layout, str(checkpoint), str(tmp_path / "out"), layout, False, timeout=120)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        saved_logits = reloaded(PROMPT).logits
    if layout == "hsdp":  # without tp (whose ranks all read what they replicate, the norms), job-wide:
        total = sum(t.numel() * t.element_size() for t in load_file(checkpoint / "model.safetensors").values())
        assert sum(result["bytes_read"] for result in results) == 2 * total  # every byte once per replica
    for result in results:
        assert result["bytes_read"] == result["local_bytes"]  # each rank read its own slices, no more
        assert result["verified"] is True
        assert result["loaded"].keys() == expected["loaded"].keys()
        for name, tensor in expected["loaded"].items():
            assert torch.equal(result["loaded"][name], tensor), name  # every parameter holds the checkpoint
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(result["logits"], saved_logits, atol=1e-5, rtol=0)
    assert expected["losses"][2] < expected["losses"][0] - 0.01, "the reference must learn (step 2 repeats batch 0)"


def test_lora_under_hsdp_over_tensor_parallel(ranks4, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "distinct", tie=True)
    expected = _reference(checkpoint, lora=True)
    for result in ranks4.run(case_layout, str(checkpoint), str(tmp_path / "adapter"), "hsdp-tp", True, timeout=120):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected["losses"]), rtol=1e-5, atol=0)
        for name, tensor in expected["loaded"].items():
            assert torch.equal(result["loaded"][name], tensor), name
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


# -- the other guarantees on the new layouts: resume, activation checkpointing, precision ----------
def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)


def case_guarantees(checkpoint: str, resume_dir: str, layout: str) -> dict:
    from nemo_wrap import load_checkpoint, save_checkpoint

    strategy, tp, replicate = LAYOUTS[layout]
    setup = DistributedSetup.build(strategy, 4, tp_size=tp, dp_replicate_size=replicate)

    def load(**options):
        return NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, **options)

    def batch(step):
        return local_micro_batches(step, setup.dp_rank(), setup.dp_size, 1)

    model, result = load(), {}
    optimizer = _optimizer(model)
    steps = [train_step(model, optimizer, batch(step)).loss for step in range(2)]
    save_checkpoint(resume_dir, model, optimizer, step=2)
    steps.append(train_step(model, optimizer, batch(2)).loss)
    resumed = load()
    resumed_optimizer = _optimizer(resumed)
    result["resumed_step"] = load_checkpoint(resume_dir, resumed, resumed_optimizer)
    result["losses"], result["after_resume"] = steps, train_step(resumed, resumed_optimizer, batch(2)).loss
    checkpointed = load()
    checkpointed.activation_checkpointing_enable()
    result["checkpointed"] = [train_step(checkpointed, _optimizer(checkpointed), batch(0)).loss]
    mixed = load(precision="bf16-mixed")
    result["bf16_mixed"] = [train_step(mixed, _optimizer(mixed), batch(step)).loss for step in range(3)]
    return result


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_activation_checkpointing_and_precision_hold_on_each_layout(ranks4, tmp_path, layout):
    checkpoint = write_checkpoint(tmp_path / "ckpt", "own-llama", "distinct", tie=True)
    expected = _reference(checkpoint, lora=False)["losses"]
    for result in ranks4.run(case_guarantees, str(checkpoint), str(tmp_path / "resume"), layout, timeout=180):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected), rtol=1e-5, atol=0)
        assert result["resumed_step"] == 2
        assert result["after_resume"] == pytest.approx(result["losses"][2], rel=1e-6)  # resumed = uninterrupted
        assert result["checkpointed"][0] == result["losses"][0]  # recomputed layers, the same loss bit for bit
        torch.testing.assert_close(torch.tensor(result["bf16_mixed"]), torch.tensor(expected), rtol=2e-2, atol=0)
