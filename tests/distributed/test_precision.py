"""``precision=``: one vocabulary for every strategy, decided by a pure plan and checked in training.

``"bf16-mixed"``: fp32 parameters and optimizer state, bf16 matmuls, fp32 gradient reduction — by
fully_shard's policy under FSDP2, by autocast elsewhere — and a loss curve within 2% of fp32.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.auto import auto_model
from nemo_wrap.distributed.hardware import fast_matmul_dtypes
from nemo_wrap.distributed.strategies.registry import SINGLE_PROCESS
from nemo_wrap.distributed.precision import default_parameter_dtype, parameter_dtype, precision_plan
from nemo_wrap.distributed.strategies.fsdp2 import FSDP2Options, with_mixed_precision
from nemo_wrap.errors import InvalidSetupError
from tests.support.checkpoints import write_checkpoint

F32, BF16 = torch.float32, torch.bfloat16
IDS = torch.arange(2 * 16).reshape(2, 16) * 5 % 257
STEPS = 20
# (strategy, world, tp) → whether fully_shard does the casting (it does when FSDP shards over dp > 1)
LAYOUTS = {
    (SINGLE_PROCESS.name, 1, 1): False,
    ("ddp", 4, 1): False,
    ("fsdp2", 4, 1): True,
    ("fsdp2", 4, 2): True,
    ("fsdp2", 2, 2): False,  # pure tensor parallel: no FSDP, so autocast
    ("megatron_fsdp", 4, 1): False,
}


@pytest.mark.parametrize(("layout", "dtype"), list(itertools.product(LAYOUTS, [F32, BF16])), ids=str)
def test_the_plan_for_every_precision_and_layout(layout, dtype):
    strategy, world, tp = layout
    dp = world // tp
    kept = precision_plan(None, dtype, strategy, dp)
    assert (kept.parameter_dtype, kept.compute_dtype, kept.reduce_dtype, kept.cast_by) == (dtype, dtype, dtype, "none")
    fp32 = precision_plan("fp32", dtype, strategy, dp)
    assert (fp32.parameter_dtype, fp32.compute_dtype, fp32.cast_by) == (F32, F32, "none")
    pure = precision_plan("bf16", dtype, strategy, dp)
    assert (pure.parameter_dtype, pure.compute_dtype, pure.reduce_dtype) == (BF16, BF16, BF16)
    assert "the optimizer state is bf16" in str(pure)
    mixed = precision_plan("bf16-mixed", dtype, strategy, dp)
    assert (mixed.parameter_dtype, mixed.compute_dtype, mixed.reduce_dtype) == (F32, BF16, F32)
    assert mixed.cast_by == ("fully_shard" if LAYOUTS[layout] else "autocast")
    assert "fp32 master weights and optimizer state, bf16 compute" in str(mixed)


def test_without_precision_the_plan_describes_fsdp2_own_dtypes():
    options = FSDP2Options(param_dtype=BF16)
    own = precision_plan(None, F32, "fsdp2", 2, options)
    assert (own.parameter_dtype, own.compute_dtype, own.reduce_dtype, own.cast_by) == (F32, BF16, F32, "fully_shard")
    assert str(own).startswith("the strategy's own dtypes: fp32 master weights and optimizer state, bf16 compute")
    assert precision_plan(None, F32, "fsdp2", 1, options).cast_by == "none"  # pure tp: no fully_shard


def test_precision_and_dtype_must_agree():
    assert parameter_dtype("bf16-mixed", None) == F32 and parameter_dtype("bf16", BF16) == BF16
    assert parameter_dtype(None, None) is None and parameter_dtype(None, BF16) == BF16
    with pytest.raises(InvalidSetupError, match=r"precision='bf16-mixed' keeps parameters in torch.float32"):
        parameter_dtype("bf16-mixed", BF16)
    with pytest.raises(InvalidSetupError, match=r"precision='fp16'"):
        parameter_dtype("fp16", None)
    with pytest.raises(InvalidSetupError, match=r"precision='half'"):
        precision_plan("half", F32, SINGLE_PROCESS.name, 1)


def test_fsdp2_options_take_the_policy_or_refuse_a_conflict():
    options = with_mixed_precision(FSDP2Options(), BF16, F32)
    assert (options.param_dtype, options.reduce_dtype) == (BF16, F32)
    assert with_mixed_precision(FSDP2Options(param_dtype=BF16), BF16, F32).reduce_dtype == F32
    with pytest.raises(InvalidSetupError, match=r"param_dtype=torch.float16\) conflicts with the precision"):
        with_mixed_precision(FSDP2Options(param_dtype=torch.float16), BF16, F32)
    conflicting = FSDP2Options(param_dtype=torch.float16)  # the plan (so plan() and the load) refuses it
    for precision in ("bf16-mixed", "fp32"):
        with pytest.raises(InvalidSetupError, match=r"param_dtype=torch.float16\) conflicts with the precision"):
            precision_plan(precision, F32, "fsdp2", 2, conflicting)
    assert precision_plan("bf16-mixed", F32, "fsdp2", 1, conflicting).cast_by == "autocast"  # pure tp: no FSDP


F16 = torch.float16
FAST_SETS = [frozenset(), frozenset({BF16}), frozenset({F16}), frozenset({BF16, F16})]


@pytest.mark.parametrize(
    ("stored", "fast", "device"), list(itertools.product([F32, BF16, F16], FAST_SETS, ["cpu", "cuda"]))
)
def test_the_default_dtype_avoids_16_bit_dtypes_the_device_multiplies_slowly(stored, fast, device):
    choice = default_parameter_dtype(stored, fast, device)
    slow = stored != F32 and stored not in fast
    assert choice.dtype == (F32 if slow else stored)
    assert ("no fast" in choice.reason) == slow and (device.upper() in choice.reason) == slow
    plan = precision_plan(None, choice.dtype, SINGLE_PROCESS.name, 1, dtype_reason=choice.reason)
    assert plan.parameter_dtype == plan.compute_dtype == choice.dtype and choice.reason in str(plan)


def test_this_cpu_s_fast_dtypes_follow_its_feature_flags():
    flags = set(open("/proc/cpuinfo").read().split())
    fast = fast_matmul_dtypes("cpu")
    assert (BF16 in fast) == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert (F16 in fast) == bool(flags & {"avx512_fp16", "amx_fp16", "asimdhp"})


@pytest.mark.parametrize("fast", [frozenset(), frozenset({BF16})], ids=["slow-bf16", "fast-bf16"])
def test_a_bf16_checkpoint_trains_in_fp32_by_default_only_where_bf16_is_slow(tmp_path, monkeypatch, fast):
    path = write_checkpoint(tmp_path / "bf16", "own-llama", "distinct", tie=False, dtype=BF16)
    monkeypatch.setattr(auto_model, "fast_matmul_dtypes", lambda device_type: fast)
    default = NeMoAutoModelForCausalLM.from_pretrained(path)
    expected = BF16 if fast else F32
    assert {p.dtype for p in default.parameters()} == {expected}
    plan = str(NeMoAutoModelForCausalLM.plan(path).precision)
    assert plan == str(default.load_report.plan.precision)
    assert ("no fast bf16 matmul" in plan) == (not fast)
    reference = NeMoAutoModelForCausalLM.from_pretrained(path, dtype="auto")  # explicit: the checkpoint's
    assert {p.dtype for p in reference.parameters()} == {BF16}
    for name, value in reference.state_dict().items():  # bf16 → fp32 is exact
        torch.testing.assert_close(default.state_dict()[name], value.to(expected), rtol=0, atol=0)
    for precision, stored in [("bf16", BF16), ("bf16-mixed", F32), ("fp32", F32)]:  # an explicit choice wins
        plan_of = NeMoAutoModelForCausalLM.plan(path, precision=precision).precision
        assert plan_of.parameter_dtype == stored and plan_of.name == precision


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("precision") / "llama", "own-llama", "distinct", tie=False))


def _train(path: str, precision: str | None, setup: DistributedSetup | None = None) -> dict:
    """``STEPS`` AdamW steps on one batch (the same on every rank); what each precision promises."""
    model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, precision=precision).train()
    assert str(model.load_report.plan.precision).startswith(precision or "fp32")
    matmul_dtypes = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: matmul_dtypes.append(_local(o).dtype))
    model.lm_head.register_forward_hook(lambda m, i, o: matmul_dtypes.append(_local(o).dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        loss = model(IDS, labels=IDS).loss
        assert not torch.is_autocast_enabled("cpu")  # autocast ends with the forward
        loss.backward()
        gradient_dtypes = {_local(p.grad).dtype for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    state_dtypes = {_local(s["exp_avg"]).dtype for s in optimizer.state.values()}
    return {
        "losses": losses,
        "parameters": {_local(p).dtype for p in model.parameters()},
        "gradients": gradient_dtypes,
        "optimizer_state": state_dtypes,
        "matmuls": set(matmul_dtypes),
        "fsdp_policy": _fsdp_policy(model),
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _fsdp_policy(model) -> tuple | None:
    """fully_shard's mixed-precision policy on the first decoder layer, if it is sharded by FSDP2."""
    get_state = getattr(model.model.layers[0], "_get_fsdp_state", None)
    if get_state is None:
        return None
    policy = get_state()._fsdp_param_group.mp_policy
    return policy.param_dtype, policy.reduce_dtype


@pytest.fixture(scope="module")
def fp32_run(checkpoint):
    return _train(checkpoint, "fp32")


def test_bf16_mixed_in_one_process(checkpoint, fp32_run):
    mixed = _train(checkpoint, "bf16-mixed")
    assert mixed["parameters"] == mixed["gradients"] == mixed["optimizer_state"] == {F32}
    assert mixed["matmuls"] == {BF16} and fp32_run["matmuls"] == {F32}
    torch.testing.assert_close(torch.tensor(mixed["losses"]), torch.tensor(fp32_run["losses"]), rtol=0.02, atol=0)
    assert fp32_run["losses"][-1] < 0.92 * fp32_run["losses"][0]  # the curve really moves


def test_pure_bf16_keeps_everything_in_bf16(checkpoint, fp32_run):
    pure = _train(checkpoint, "bf16")
    assert pure["parameters"] == pure["gradients"] == pure["optimizer_state"] == pure["matmuls"] == {BF16}


def test_autocast_ends_when_the_forward_raises(checkpoint):
    model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, precision="bf16-mixed")
    with pytest.raises(IndexError):
        model(IDS + 10_000)  # token ids past the vocabulary
    assert not torch.is_autocast_enabled("cpu")
    assert model(IDS).logits.dtype == BF16


def case_bf16_mixed(path: str, strategy: str, tp: int) -> dict:
    return _train(path, "bf16-mixed", DistributedSetup.build(strategy, dist.get_world_size(), tp_size=tp))


def test_bf16_mixed_on_2_ranks_agrees_across_strategies(ranks2, checkpoint, fp32_run):
    curves = {}
    for strategy, tp in [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)]:
        results = ranks2.run(case_bf16_mixed, checkpoint, strategy, tp)
        for result in results:
            assert result["parameters"] == result["gradients"] == result["optimizer_state"] == {F32}
            assert result["matmuls"] == {BF16}
            expected_policy = (BF16, F32) if (strategy, tp) == ("fsdp2", 1) else None
            assert result["fsdp_policy"] == expected_policy
        curves[(strategy, tp)] = torch.tensor(results[0]["losses"])
    for curve in curves.values():
        torch.testing.assert_close(curve, torch.tensor(fp32_run["losses"]), rtol=0.02, atol=0)
        torch.testing.assert_close(curve, curves[("ddp", 1)], rtol=1e-2, atol=0)
