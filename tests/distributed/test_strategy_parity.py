"""The core promise of the sharding managers: the same losses (and weights) as one process.

The same seeded weights (topology-invariant init) and the same global batches, split over the
data-parallel ranks with *unequal* label-token counts, trained by ``train_step`` under every
strategy on real gloo ranks, against the same steps in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.training import train_step
from tests.support.batches import local_micro_batches
from tests.support.tiny_models import tiny_config

SEED = 7
MODELS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-qk-norm": ("qwen3", dict(tie_word_embeddings=False)),  # per-head norms under TP
    "own-llama-tied": ("own-llama", dict(tie_word_embeddings=True)),  # our fused class
    "own-qwen3": ("own-qwen3", dict(tie_word_embeddings=False)),
}


def _full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _train(model, setup, optimizer_name: str, steps: int, micro: int, max_grad_norm=None):
    if setup is None:
        dp_rank, dp_size = 0, 1
    else:
        mesh = setup.device_mesh()
        dp_rank, dp_size = mesh.get_local_rank("dp"), setup.dp_size
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    results = [
        train_step(model, optimizer, local_micro_batches(step, dp_rank, dp_size, micro), max_grad_norm=max_grad_norm)
        for step in range(steps)
    ]
    return [r.loss for r in results], [r.grad_norm for r in results], [r.label_tokens for r in results]


def _build(model_key: str, setup):
    kind, overrides = MODELS[model_key]
    return NeMoAutoModelForCausalLM.from_config(tiny_config(kind, **overrides), distributed_setup=setup, seed=SEED)


def case_train(model_key, strategy, world_size, tp_size, optimizer_name, steps, micro, max_grad_norm=None,
               sequence_parallel=False):  # fmt: skip
    setup = DistributedSetup.build(strategy, world_size, tp_size=tp_size, sequence_parallel=sequence_parallel)
    model = _build(model_key, setup)
    if sequence_parallel:  # what sequence parallel is for: the checkpointed layers keep 1/tp of their inputs
        model.activation_checkpointing_enable()
    losses, norms, tokens = _train(model, setup, optimizer_name, steps, micro, max_grad_norm)
    weights = _full_weights(model) if optimizer_name == "sgd" else None
    return losses, norms, tokens, weights


_REFERENCE_CACHE: dict = {}


def _reference(model_key, optimizer_name, steps, max_grad_norm=None):
    key = (model_key, optimizer_name, steps, max_grad_norm)
    if key not in _REFERENCE_CACHE:
        model = _build(model_key, None)
        losses, norms, tokens = _train(model, None, optimizer_name, steps, 1, max_grad_norm)
        _REFERENCE_CACHE[key] = (losses, norms, tokens, _full_weights(model))
    return _REFERENCE_CACHE[key]


STRATEGIES_ON_TWO = [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)]


@pytest.mark.parametrize("model_key", list(MODELS))
@pytest.mark.parametrize(("strategy", "tp_size"), STRATEGIES_ON_TWO, ids=["ddp", "fsdp2", "tp2"])
def test_adamw_loss_curve_matches_one_process(ranks2, model_key, strategy, tp_size):
    expected_losses, _, expected_tokens, _ = _reference(model_key, "adamw", 4)
    for losses, _, tokens, _ in ranks2.run(case_train, model_key, strategy, 2, tp_size, "adamw", 4, 1):
        assert tokens == expected_tokens
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    assert expected_losses[2] < expected_losses[0] - 0.1, "the reference must learn (step 2 repeats batch 0)"


@pytest.mark.parametrize("model_key", list(MODELS))
@pytest.mark.parametrize(("strategy", "tp_size"), STRATEGIES_ON_TWO, ids=["ddp", "fsdp2", "tp2"])
def test_sgd_final_weights_match_one_process(ranks2, model_key, strategy, tp_size):
    _, _, _, expected_weights = _reference(model_key, "sgd", 3)
    for _, _, _, weights in ranks2.run(case_train, model_key, strategy, 2, tp_size, "sgd", 3, 1):
        assert weights.keys() == expected_weights.keys()
        for name, tensor in expected_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    ("model_key", "sequence_parallel"),
    [("llama-tied", False), ("qwen2-bias", False), ("qwen3-qk-norm", False), ("own-llama-tied", False),
     ("own-qwen3", True), ("own-llama-tied", True)],
    ids=["llama-tied", "qwen2-bias", "qwen3-qk-norm", "own-llama-tied", "own-qwen3-sequence-parallel",
         "own-llama-tied-sequence-parallel"],
)  # fmt: skip
def test_fsdp2_over_tensor_parallel_two_by_two(ranks4, model_key, sequence_parallel):
    expected_losses, _, _, _ = _reference(model_key, "adamw", 4)
    _, _, _, expected_weights = _reference(model_key, "sgd", 3)
    for losses, _, _, _ in ranks4.run(case_train, model_key, "fsdp2", 4, 2, "adamw", 4, 1, None, sequence_parallel):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)
    for _, _, _, weights in ranks4.run(case_train, model_key, "fsdp2", 4, 2, "sgd", 3, 1, None, sequence_parallel):
        for name, tensor in expected_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_clipping_across_one_and_two_dimensional_meshes(ranks4):
    """FSDP2×TP mixes 1-D and 2-D meshes, where torch's clip_grad_norm_ raises; ours matches one process."""
    expected_losses, expected_norms, _, _ = _reference("llama-untied", "adamw", 3, max_grad_norm=0.5)
    assert all(n > 0.5 for n in expected_norms), "the clip must actually bind"
    for losses, norms, _, _ in ranks4.run(case_train, "llama-untied", "fsdp2", 4, 2, "adamw", 3, 1, 0.5):
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)


def case_torch_clip_raises_on_mixed_meshes():
    setup = DistributedSetup.build("fsdp2", 4, tp_size=2)
    model = _build("llama-untied", setup)
    batch = local_micro_batches(0, setup.device_mesh().get_local_rank("dp"), 2, 1)[0]
    model(**batch).loss.backward()
    meshes = {p.device_mesh.ndim for p in model.parameters() if isinstance(p, DTensor)}
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except Exception as error:  # noqa: BLE001 - which error torch raises is its business
        return meshes, type(error).__name__
    return meshes, None


def test_torch_clip_grad_norm_fails_where_ours_is_needed(ranks4):
    for meshes, error in ranks4.run(case_torch_clip_raises_on_mixed_meshes):
        assert meshes == {1, 2}
        assert error is not None


@pytest.mark.parametrize(("strategy", "tp_size"), [("ddp", 1), ("fsdp2", 1)], ids=["ddp", "fsdp2"])
def test_gradient_accumulation_matches_one_big_batch(ranks2, strategy, tp_size):
    expected_losses, _, _, _ = _reference("llama-untied", "adamw", 3)
    for losses, _, _, _ in ranks2.run(case_train, "llama-untied", strategy, 2, tp_size, "adamw", 3, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=0)


def test_same_run_twice_gives_identical_losses(ranks2):
    first = ranks2.run(case_train, "qwen2-bias", "fsdp2", 2, 1, "adamw", 3, 1)
    second = ranks2.run(case_train, "qwen2-bias", "fsdp2", 2, 1, "adamw", 3, 1)
    assert [r[0] for r in first] == [r[0] for r in second]
