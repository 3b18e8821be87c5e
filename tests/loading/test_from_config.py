"""from_config: the same full weights under every strategy as in one process (topology invariance)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.distributed.hardware import fast_matmul_dtypes
from nemo_wrap.auto.pipeline import build_on_meta as _build_on_meta
from nemo_wrap.auto.pipeline import materialize as _materialize
from nemo_wrap.models.registry import resolve_model_source
from tests.support.tiny_models import ALL_KINDS, OWN_KINDS, TENSOR_PARALLEL_KINDS, tiny_config

SEED = 1234


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full, plain tensor (DTensors gathered)."""
    state = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().clone()
    return state


def _reference(kind: str) -> dict[str, torch.Tensor]:
    return _full_state(NeMoAutoModelForCausalLM.from_config(tiny_config(kind), seed=SEED))


def case_full_state(kind: str, strategy: str, tp_size: int, world_size: int) -> dict[str, torch.Tensor]:
    setup = DistributedSetup.build(strategy, world_size, tp_size=tp_size)
    model = NeMoAutoModelForCausalLM.from_config(tiny_config(kind), distributed_setup=setup, seed=SEED)
    return _full_state(model)


def case_own_weights_before_any_broadcast(kind: str) -> dict[str, torch.Tensor]:
    """DDP's replicas before ``replicate`` broadcasts rank 0's weights: each rank's own init."""
    config = tiny_config(kind)
    model = _build_on_meta(resolve_model_source(config).model_class, config, torch.float32)
    _materialize(model, torch.device("cpu"))
    model.initialize_weights(seed=SEED)
    return _full_state(model)


def _assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{where}: {name} differs from the one-process init"


@pytest.mark.parametrize("kind", ALL_KINDS + OWN_KINDS)
def test_ddp_replicas_initialize_identically_before_broadcast(ranks2, kind):
    expected = _reference(kind)
    for rank, state in enumerate(ranks2.run(case_own_weights_before_any_broadcast, kind)):
        _assert_same_state(state, expected, f"{kind} rank {rank}")


@pytest.mark.parametrize("kind", ALL_KINDS + OWN_KINDS)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_equal_one_process(ranks2, kind, strategy):
    expected = _reference(kind)
    for rank, state in enumerate(ranks2.run(case_full_state, kind, strategy, 1, 2)):
        _assert_same_state(state, expected, f"{kind} {strategy} rank {rank}")


@pytest.mark.parametrize("kind", TENSOR_PARALLEL_KINDS + OWN_KINDS)
def test_tensor_parallel_equals_one_process(ranks2, kind):
    expected = _reference(kind)
    for rank, state in enumerate(ranks2.run(case_full_state, kind, "fsdp2", 2, 2)):
        _assert_same_state(state, expected, f"{kind} tp=2 rank {rank}")


@pytest.mark.parametrize("kind", ["llama", "own-llama", "own-qwen3"])
def test_fsdp2_over_tensor_parallel_equals_one_process(ranks4, kind):
    expected = _reference(kind)
    for rank, state in enumerate(ranks4.run(case_full_state, kind, "fsdp2", 2, 4)):
        _assert_same_state(state, expected, f"{kind} 2x2 rank {rank}")


def test_fresh_model_is_initialized_not_leftover_memory():
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=SEED)
    state = _full_state(model)
    assert all(torch.isfinite(t).all() for t in state.values())
    embedding = state["model.embed_tokens.weight"]
    assert torch.count_nonzero(embedding[3]) == 0  # padding row
    assert abs(embedding.std().item() - 0.02) < 0.002  # config.initializer_range
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=tokens, labels=tokens).loss.item()
    assert abs(loss - math.log(257)) < 0.15  # garbage memory gives NaN or far larger


def test_dtype_default_is_config_dtype_and_can_be_overridden():
    config = tiny_config("llama", dtype=torch.bfloat16)
    model = NeMoAutoModelForCausalLM.from_config(config, seed=SEED, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # with no dtype at all, bf16 is kept only where this CPU multiplies it fast (else fp32)
    default = NeMoAutoModelForCausalLM.from_config(config, seed=SEED)
    fast = torch.bfloat16 in fast_matmul_dtypes("cpu")
    assert {p.dtype for p in default.parameters()} == {torch.bfloat16 if fast else torch.float32}
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=SEED, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def case_tied_embedding_stays_one_parameter(strategy: str, tp_size: int) -> tuple[bool, str, dict[str, torch.Tensor]]:
    setup = DistributedSetup.build(strategy, 2, tp_size=tp_size)
    config = tiny_config("llama", tie_word_embeddings=True)
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, seed=SEED)
    embedding, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    placements = str(embedding.placements) if isinstance(embedding, DTensor) else "plain"
    return lm_head is embedding, placements, _full_state(model)


@pytest.mark.parametrize(("strategy", "tp_size", "placements"), [("fsdp2", 1, "(Shard(dim=0),)"), ("fsdp2", 2, "(Shard(dim=0),)"), ("ddp", 1, "plain")])
def test_tied_embedding_stays_one_parameter(ranks2, strategy, tp_size, placements):
    expected = _full_state(NeMoAutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=True), seed=SEED))
    assert torch.count_nonzero(expected["model.embed_tokens.weight"][3]) == 0
    for rank, (is_tied, actual_placements, state) in enumerate(ranks2.run(case_tied_embedding_stays_one_parameter, strategy, tp_size)):
        assert is_tied, f"rank {rank}: lm_head.weight is not the embedding parameter"
        assert actual_placements == placements
        _assert_same_state(state, expected, f"tied {strategy} tp={tp_size} rank {rank}")


def test_saved_fallback_model_names_the_transformers_architecture(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    model = NeMoAutoModelForCausalLM.from_config(tiny_config("qwen2"), seed=SEED, force_hf=True)
    assert type(model).__name__ == "NeMoQwen2ForCausalLM"
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    tokens = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, model(input_ids=tokens).logits, atol=0, rtol=0)


@pytest.mark.parametrize("kind", OWN_KINDS)
def test_own_classes_draw_transformers_distributions(kind):
    """Our fused classes, initialized by our seeded walk, match transformers' init statistically."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, hidden_size=128, intermediate_size=256)
    ours = NeMoAutoModelForCausalLM.from_config(config, seed=SEED)
    ours_hf = ours.state_dict_adapter().to_hf(ours.state_dict())
    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(config).state_dict()
    assert ours_hf.keys() == theirs.keys()
    for name, reference in theirs.items():
        value = ours_hf[name].float()
        if (reference == reference.flatten()[0]).all():  # norms (ones), biases (zeros)
            assert torch.equal(value, reference.float()), name
        elif reference.numel() >= 4096:
            assert abs(value.std().item() / reference.std().item() - 1) < 0.08, name
            assert abs(value.mean().item()) < 0.002, name
    assert not ours_hf["model.embed_tokens.weight"][config.pad_token_id].any()
