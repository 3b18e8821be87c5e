"""The load plan: one pure function, its invariants checked over the whole cross product."""

from __future__ import annotations

import dataclasses
import itertools
import shutil

import pytest
from peft import LoraConfig
from transformers import BitsAndBytesConfig

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import InvalidSetupError, UnsupportedQuantizationError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import Step
from nemo_wrap.loading.resolve import CheckpointFacts, LoadRequest, Machine, resolve_load_plan
from nemo_wrap.models.registry import resolve_model_source
from tests.support.checkpoints import write_checkpoint
from tests.support.tiny_models import tiny_config

STRATEGIES = (None, "ddp", "fsdp2", "megatron_fsdp")  # None: distributed_setup=None, one process
# 4 layers (2 pipeline stages of 2), 4 KV heads (tensor parallel up to 4)
CONFIGS = {custom: tiny_config("own-llama" if custom else "llama", num_hidden_layers=4, num_key_value_heads=4)
           for custom in (True, False)}  # fmt: skip


NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")


def _combinations():
    for is_custom, strategy, world, tp, pp, has_checkpoint, adapters, compile_layers, quantized in itertools.product(
        (True, False), STRATEGIES, (1, 2, 4, 8), (1, 2, 4), (1, 2), (True, False), (None, "new", "file"), (False, True),
        (False, True),
    ):  # fmt: skip
        if world % (tp * pp) or (strategy in (None, "megatron_fsdp") and tp > 1) or (strategy is None and world > 1):
            continue
        if (adapters == "file" and not has_checkpoint) or (compile_layers and tp > 1) or (pp > 1 and strategy != "fsdp2"):
            continue
        setup = DistributedSetup.given(
            None if strategy is None else DistributedSetup.build(strategy, world, tp_size=tp, pp_size=pp)
        )
        lora = {None: {}, "new": {"peft_config": LoraConfig()}, "file": {"adapter": "adapter/"}}[adapters]
        options = LoadOptions(compile=compile_layers, quantization_config=NF4 if quantized else None, **lora)
        yield (is_custom, setup, has_checkpoint, options)


def _resolve(is_custom, setup, has_checkpoint, options):
    """The plan the one resolver makes for a tiny Llama (our class or transformers'), headers only."""
    config = CONFIGS[is_custom]
    source = resolve_model_source(config, force_hf=not is_custom)
    checkpoint = CheckpointFacts((), ()) if has_checkpoint else None
    return resolve_load_plan(LoadRequest(source, config, setup, options, checkpoint, Machine("cpu", frozenset())))


def _quantization_composes(setup, has_checkpoint: bool, options: LoadOptions) -> bool:
    """Where 4-bit layers are built: a checkpoint, one process, ddp or fsdp2, no tp/pp, not compiled."""
    if setup.strategy == "megatron_fsdp" or setup.tp_size > 1 or setup.degrees.pp > 1:
        return False
    return has_checkpoint and not options.compile


def _all_plans():
    for is_custom, setup, has_checkpoint, options in _combinations():
        if options.quantization_config is None or _quantization_composes(setup, has_checkpoint, options):
            yield _resolve(is_custom, setup, has_checkpoint, options)


PLANS = list(_all_plans())


def test_cross_product_is_large():
    # custom × (checkpoint × 3 adapter kinds + no checkpoint × 2) × (none, ddp, megatron, fsdp2 setups;
    # ddp and fsdp2 with tensor parallel), each setup also compiled unless it uses tensor parallel (13 of 23);
    # plus fsdp2 with pp=2 (6 setups, 3 of them also compiled); plus 4-bit: custom × checkpoint × 3 adapter
    # kinds × the 1 + 4 + 4 eager setups without tp, pp or megatron
    assert len(PLANS) == 2 * (3 + 2) * ((1 + 9 + 4 + 9) + 13 + (6 + 3)) + 2 * 3 * (1 + 4 + 4)


def test_every_combination_4bit_does_not_compose_with_is_refused_by_name():
    refused = 0
    for is_custom, setup, has_checkpoint, options in _combinations():
        if options.quantization_config is not None and not _quantization_composes(setup, has_checkpoint, options):
            with pytest.raises(UnsupportedQuantizationError, match="quantization_config does not compose with"):
                _resolve(is_custom, setup, has_checkpoint, options)
            refused += 1
    assert refused > 100


def test_compiling_with_tensor_parallel_is_refused():
    with pytest.raises(InvalidSetupError, match=r"compile=True does not compose with tp_size=2"):
        _resolve(True, DistributedSetup.build("fsdp2", 4, 2), True, LoadOptions(compile=True))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.strategy}-w{p.world_size}-tp{p.tp_size}-pp{len(p.stages) or 1}-{'ckpt' if p.has_checkpoint else 'none'}-{'custom' if p.is_custom else 'hf'}-lora-{p.adapters}-{'compiled' if Step.COMPILE_LAYERS in p.steps else 'eager'}{'-4bit' if p.quantization else ''}")
def test_every_plan_reads_the_checkpoint_exactly_once_after_its_storage_exists(plan):
    steps = list(plan.steps)
    assert plan.checkpoint_reads == (1 if plan.has_checkpoint else 0)
    assert not plan.weights_arrive_with_build and plan.init_device == "meta"
    assert steps[0] is Step.BUILD_ON_META and steps[-1] is Step.AUDIT
    assert steps.count(Step.MATERIALIZE) == 1 and steps.count(Step.INITIALIZE_REST) == 1
    assert steps.count(Step.SHARD) == (1 if plan.setup.is_collective else 0)
    if plan.has_checkpoint:
        assert steps.index(Step.MATERIALIZE) < steps.index(Step.READ_CHECKPOINT) < steps.index(Step.INITIALIZE_REST)
    assert steps.count(Step.ADD_ADAPTERS) == (plan.adapters is not None)
    if Step.COMPILE_LAYERS in steps:  # compiled once the model is complete: sharded, read, initialized
        assert steps.index(Step.COMPILE_LAYERS) == len(steps) - 2 and plan.tp_size == 1
    if plan.stages:  # a stage keeps its modules before adapters, sharding and any allocation
        assert steps.index(Step.KEEP_STAGE) == 1 and len(plan.stages) == 2 and "pipeline stage 1" in str(plan)
    else:
        assert Step.KEEP_STAGE not in steps
    if plan.quantization is not None:  # 4-bit layers exist before adapters (which adapt them) and sharding
        assert steps.index(Step.QUANTIZE_LAYERS) == 1 and steps.index(Step.MATERIALIZE) > 1
        assert "quantized as they are read" in plan.read_scope and "quantization: bitsandbytes 4-bit NF4" in str(plan)
    else:
        assert Step.QUANTIZE_LAYERS not in steps
    if plan.adapters is not None:  # adapters exist before anything is sharded or allocated
        after = bool(plan.stages) + (plan.quantization is not None)
        assert steps.index(Step.ADD_ADAPTERS) == 1 + after and "LoRA adapters" in str(plan)
    if plan.strategy == "fsdp2":  # shards on meta: each rank allocates and reads only its shard
        assert steps.index(Step.SHARD) < steps.index(Step.MATERIALIZE)
        assert "only the slices of its own shards" in plan.read_scope or not plan.has_checkpoint
    elif plan.strategy in ("ddp", "megatron_fsdp") and plan.tp_size == 1:  # the field's defect: these must still read
        assert steps.index(Step.SHARD) > steps.index(Step.INITIALIZE_REST)
        assert "full tensors" in plan.read_scope or not plan.has_checkpoint
    elif plan.strategy == "ddp":  # DDP × TP: tensor parallel shards the meta model, replicas read their slices
        assert steps.index(Step.SHARD) < steps.index(Step.MATERIALIZE)
        assert "only the slices of its own shards" in plan.read_scope or not plan.has_checkpoint


def test_plan_prints_as_a_short_explanation():
    resolved = _resolve(True, DistributedSetup.build("ddp", 2), True, LoadOptions())
    plan = dataclasses.replace(resolved, source_reason="LlamaForCausalLM is in MODEL_ARCH_MAPPING")
    text = str(plan)
    assert text.splitlines()[0].startswith("load plan: NeMoLlamaForCausalLM (custom: LlamaForCausalLM is in MODEL_ARCH_MAPPING), ddp on 2 rank(s)")
    assert "weights arrive with the build: no" in text
    assert "3. read the checkpoint into place" in text and "5. shard" in text
    # 12 lines before the precision and loss lines, which every resolved plan has (the hand-made plan
    # this test used before the resolver had neither)
    lines = text.splitlines()
    assert len(lines) <= 14 and lines[-2].startswith("  precision: fp32") and lines[-1].startswith("  loss: chunked")
    fsdp2 = str(_resolve(True, DistributedSetup.build("fsdp2", 2, reshard_after_forward="never"), True, LoadOptions()))
    assert "  fsdp2 groups: reshard after forward: never, the next layer gathered while one computes" in fsdp2


def test_plan_of_a_checkpoint_reads_no_weights(tmp_path, monkeypatch):
    """plan() for a 2-rank setup, from one process: headers only (the weights are garbage)."""
    path = write_checkpoint(tmp_path / "ckpt", "llama", "half", tie=False)
    raw = (path / "model.safetensors").read_bytes()
    data_start = 8 + int.from_bytes(raw[:8], "little")
    (path / "model.safetensors").write_bytes(raw[:data_start] + b"\xff" * (len(raw) - data_start))

    def no_reads(*args, **kwargs):
        raise AssertionError("plan() read a weight")

    monkeypatch.setattr("nemo_wrap.checkpoint.safetensors_file.BlockReader.block", no_reads)
    setup = DistributedSetup.build("fsdp2", 2, tp_size=2)
    plan = NeMoAutoModelForCausalLM.plan(path, distributed_setup=setup, force_hf=True)
    assert plan.has_checkpoint and plan.strategy == "fsdp2" and plan.tp_size == 2
    assert plan.model_class == "NeMoLlamaForCausalLM" and not plan.is_custom
    config_plan = NeMoAutoModelForCausalLM.plan(tiny_config("llama"))
    assert not config_plan.has_checkpoint and config_plan.checkpoint_reads == 0
    with pytest.raises(AssertionError, match="plan\\(\\) read a weight"):  # the patch does catch a read
        NeMoAutoModelForCausalLM.from_pretrained(path, force_hf=True)


@pytest.mark.parametrize(
    ("kind", "overrides", "tp", "named"),
    [
        ("llama", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), 2, "num_key_value_heads=3"),
        ("own-llama", dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=72), 2, "num_key_value_heads=3"),
        ("qwen2", dict(num_key_value_heads=2), 4, "num_key_value_heads=2, tp_size=4"),
        ("llama", dict(num_key_value_heads=4, intermediate_size=130), 4, "intermediate_size=130"),
        ("gpt2", {}, 2, "no tensor-parallel plan"),
    ],
    ids=["kv3-tp2", "own-kv3-tp2", "kv2-tp4", "intermediate130-tp4", "gpt2-no-plan"],
)
def test_plan_refuses_what_the_load_refuses_with_the_same_error(tmp_path, kind, overrides, tp, named):
    """The dry run and the load share one check; nothing is read, no process group is needed."""
    from transformers import AutoModelForCausalLM

    from nemo_wrap import ShardingError

    AutoModelForCausalLM.from_config(tiny_config(kind, **overrides)).save_pretrained(tmp_path)
    setup = DistributedSetup.build("fsdp2", 2 * tp, tp_size=tp)
    with pytest.raises(ShardingError, match=named) as planned:
        NeMoAutoModelForCausalLM.plan(tmp_path, distributed_setup=setup)
    with pytest.raises(ShardingError) as loaded:
        NeMoAutoModelForCausalLM.from_pretrained(tmp_path, distributed_setup=setup)
    assert str(planned.value) == str(loaded.value)


@pytest.mark.parametrize(("kind", "refused"), [("own-llama", False), ("llama", True), ("own-qwen3", False)])
def test_sequence_parallel_is_planned_where_the_architecture_has_a_plan_for_it(kind, refused):
    """Our fused classes cut the stream along the sequence; transformers' classes have no such plan."""
    from nemo_wrap.errors import UnsupportedSetupError

    setup = DistributedSetup.build("fsdp2", 4, tp_size=2, sequence_parallel=True)
    if refused:
        with pytest.raises(UnsupportedSetupError, match="has no sequence-parallel plan.*sequence_parallel=False"):
            NeMoAutoModelForCausalLM.plan(tiny_config(kind), distributed_setup=setup)
        return
    plan = NeMoAutoModelForCausalLM.plan(tiny_config(kind), distributed_setup=setup)
    assert "sequence parallel: between blocks each tp rank holds 1/2 of every sequence" in str(plan)
