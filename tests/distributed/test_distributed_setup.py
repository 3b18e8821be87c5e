"""DistributedSetup: validation before any collective, lazy meshes on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_wrap import (
    DistributedSetup,
    DistributedStateError,
    InvalidSetupError,
    NeMoWrapError,
    StrategyUnavailableError,
)
from nemo_wrap.distributed.strategies.fsdp2 import FSDP2Options, ReshardAfterForward


# -- pure data, one process --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(strategy="zero3", world_size=2), "strategy='zero3'"),
        (dict(strategy="megatron_fsdp", world_size=2, tp_size=2), "tp_size=2"),  # ddp takes tp since DDP x TP
        (dict(strategy="fsdp2", world_size=6, tp_size=4), "world_size=6 is not divisible by tp_size=4"),
        (dict(strategy="fsdp2", world_size=0), "world_size"),
        (dict(strategy="fsdp2", world_size=2, tp_size=0), "tp_size"),
        (dict(strategy="fsdp2", world_size=True), "world_size"),
        (dict(strategy="fsdp2", world_size=2.0), "world_size"),
        (dict(strategy="fsdp2", world_size=2, bucket_cap_mb=25), "bucket_cap_mb"),
        (dict(strategy="ddp", world_size=2, reshard_after_forward=False), "reshard_after_forward"),
        (dict(strategy="fsdp2", world_size=2, param_dtype="bf16"), "param_dtype"),
        (dict(strategy="fsdp2", world_size=2, reshard_after_forward="yes"), "reshard_after_forward='yes'"),
        (dict(strategy="fsdp2", world_size=2, reshard_after_forward=False), "'layers', 'always', 'never'"),
        (dict(strategy="fsdp2", world_size=2, sequence_parallel=True), "sequence_parallel=True"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, named):
    with pytest.raises(InvalidSetupError) as excinfo:
        DistributedSetup.build(**kwargs)
    assert named in str(excinfo.value)
    assert isinstance(excinfo.value, NeMoWrapError) and isinstance(excinfo.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_megatron_fsdp_without_cuda_names_the_alternative():
    """Describing a megatron_fsdp job works anywhere; loading with it here refuses, before any work."""
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from tests.support.tiny_models import tiny_config

    setup = DistributedSetup.build("megatron_fsdp", world_size=8)
    assert "megatron_fsdp on 8 rank(s)" in str(NeMoAutoModelForCausalLM.plan(tiny_config("llama"), setup))
    with pytest.raises(StrategyUnavailableError) as excinfo:
        NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), distributed_setup=setup)
    message = str(excinfo.value)
    assert "CUDA" in message and "strategy='fsdp2'" in message


@pytest.mark.parametrize(
    ("strategy", "world", "tp", "mesh", "dp", "fsdp"),
    [
        ("ddp", 4, 1, (4,), 4, False),
        ("fsdp2", 4, 1, (4, 1), 4, True),
        ("fsdp2", 4, 2, (2, 2), 2, True),
        ("fsdp2", 2, 2, (1, 2), 1, False),  # pure tensor parallel: no FSDP on a size-1 axis
        ("fsdp2", 1, 1, (1, 1), 1, False),
    ],
)
def test_derived_facts(strategy, world, tp, mesh, dp, fsdp):
    setup = DistributedSetup.build(strategy, world, tp_size=tp)
    assert setup.mesh_shape == mesh
    assert setup.dp_size == dp
    assert setup.uses_fsdp is fsdp
    assert setup.uses_tensor_parallel is (tp > 1)
    assert setup.mesh_dim_names == (("dp", "tp") if strategy == "fsdp2" else ("dp",))


def test_setup_is_frozen_comparable_and_describable_without_a_process_group():
    setup = DistributedSetup.build(
        "fsdp2", world_size=8, tp_size=2, reshard_after_forward="never", param_dtype=torch.bfloat16
    )
    assert setup == DistributedSetup.build("fsdp2", 8, 2, param_dtype=torch.bfloat16, reshard_after_forward="never")
    assert hash(setup) == hash(
        DistributedSetup.build("fsdp2", 8, 2, param_dtype=torch.bfloat16, reshard_after_forward="never")
    )
    assert setup.options == FSDP2Options(reshard_after_forward=ReshardAfterForward.NEVER, param_dtype=torch.bfloat16)
    assert "reshard after forward: never, the next layer gathered while one computes, param_dtype=torch.bfloat16" in setup.describe()
    assert "no prefetch" in DistributedSetup.build("fsdp2", 8, prefetch=False).describe()
    assert "reshard after forward: layers" in DistributedSetup.build("fsdp2", 8).describe()
    with pytest.raises(AttributeError):
        setup.world_size = 4  # type: ignore[misc]
    text = setup.describe()
    assert "8 rank(s)" in text and "dp=4, tp=2" in text and "tensor parallel over tp=2" in text
    pure_tp = DistributedSetup.build("fsdp2", 2, tp_size=2).describe()
    assert "no FSDP" in pure_tp


def test_mesh_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(DistributedStateError) as excinfo:
        DistributedSetup.build("fsdp2", 2).device_mesh()
    assert "initialize_distributed" in str(excinfo.value)


# -- real meshes on 2 and 4 gloo ranks --------------------------------------------------------
def case_meshes_on_two_ranks():
    results = {}
    for strategy, tp in (("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)):
        setup = DistributedSetup.build(strategy, 2, tp_size=tp)
        mesh = setup.device_mesh()
        assert mesh is setup.device_mesh(), "mesh must be created once and cached"
        results[(strategy, tp)] = (tuple(mesh.shape), mesh.mesh_dim_names, list(mesh.get_coordinate()))
    return results


def test_meshes_on_two_ranks(ranks2):
    rank0, rank1 = ranks2.run(case_meshes_on_two_ranks)
    assert rank0[("ddp", 1)] == ((2,), ("dp",), [0])
    assert rank1[("ddp", 1)] == ((2,), ("dp",), [1])
    assert rank0[("fsdp2", 1)] == ((2, 1), ("dp", "tp"), [0, 0])
    assert rank1[("fsdp2", 1)] == ((2, 1), ("dp", "tp"), [1, 0])
    assert rank0[("fsdp2", 2)] == ((1, 2), ("dp", "tp"), [0, 0])
    assert rank1[("fsdp2", 2)] == ((1, 2), ("dp", "tp"), [0, 1])


def case_world_size_mismatch_raises_everywhere():
    with pytest.raises(DistributedStateError) as excinfo:
        DistributedSetup.build("fsdp2", world_size=4, tp_size=2).device_mesh()
    return str(excinfo.value)


def test_world_size_mismatch_raises_on_every_rank_without_collective(ranks2):
    messages = ranks2.run(case_world_size_mismatch_raises_everywhere, timeout=30)
    assert all("world_size=4" in m and "2 rank(s)" in m for m in messages)


def case_two_by_two_mesh():
    mesh = DistributedSetup.build("fsdp2", 4, tp_size=2).device_mesh()
    dp_group_ranks = dist.get_process_group_ranks(mesh.get_group("dp"))
    tp_group_ranks = dist.get_process_group_ranks(mesh.get_group("tp"))
    return list(mesh.get_coordinate()), dp_group_ranks, tp_group_ranks


def test_two_by_two_mesh_on_four_ranks(ranks4):
    results = ranks4.run(case_two_by_two_mesh)
    assert [r[0] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [r[1] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]  # dp groups stride over tp
    assert [r[2] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # tp groups are neighbours


# -- a strategy registered from outside the package ---------------------------------------------
def _toy_entry(applied: list):
    """DDP's apply under another name, recording its calls: everything else must come from the entry."""
    from nemo_wrap.distributed.strategies import StrategyEntry
    from nemo_wrap.distributed.strategies.ddp import DDPOptions, apply_ddp

    def apply(model, mesh, options):
        applied.append((tuple(mesh.shape), options))
        return apply_ddp(model, mesh, options)

    return StrategyEntry(
        name="toy_replicate",
        options_class=DDPOptions,
        shards_on_meta=False,
        shards_parameters=False,
        apply=apply,
        check_available=lambda: None,
    )


def test_a_registered_strategy_is_validated_described_and_planned_from_its_entry(monkeypatch):
    from nemo_wrap.distributed.strategies import registry
    from nemo_wrap.loading.plan import Step
    from nemo_wrap.loading.resolve import CheckpointFacts, LoadRequest, LoadOptions, Machine, resolve_load_plan
    from nemo_wrap.models.registry import resolve_model_source
    from tests.support.tiny_models import tiny_config

    monkeypatch.setitem(registry._REGISTRY, "toy_replicate", _toy_entry([]))
    setup = DistributedSetup.build("toy_replicate", 4)
    assert setup.mesh_shape == (4,) and setup.mesh_dim_names == ("dp",) and not setup.uses_fsdp
    assert "every rank holds the whole model" in setup.describe()
    with pytest.raises(InvalidSetupError, match="tp_size=2"):
        DistributedSetup.build("toy_replicate", 4, tp_size=2)
    with pytest.raises(InvalidSetupError, match="reshard_after_forward"):
        DistributedSetup.build("toy_replicate", 4, reshard_after_forward=True)
    config = tiny_config("llama")
    request = LoadRequest(resolve_model_source(config, False), config, setup, LoadOptions(), CheckpointFacts((), ()),
                          Machine("cpu", frozenset()))  # fmt: skip
    steps = resolve_load_plan(request).steps
    assert steps.index(Step.SHARD) > steps.index(Step.READ_CHECKPOINT)  # needs real weights first


def case_registered_strategy_shards_and_matches_one_process():
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.distributed.strategies import register_strategy, registry
    from tests.support.tiny_models import tiny_config

    applied: list = []
    register_strategy(_toy_entry(applied))
    try:
        setup = DistributedSetup.build("toy_replicate", 2)
        model = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), distributed_setup=setup, seed=4)
    finally:
        registry._REGISTRY.pop("toy_replicate")
    reference = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=4)
    same = all(torch.equal(t, reference.state_dict()[n]) for n, t in model.state_dict().items())
    return applied[0][0], model.nemo_state.setup.strategy, same


def test_a_registered_strategy_shards_models_on_two_ranks(ranks2):
    for mesh_shape, strategy, same in ranks2.run(case_registered_strategy_shards_and_matches_one_process):
        assert mesh_shape == (2,) and strategy == "toy_replicate" and same
