"""``model.activation_checkpointing_enable()``, transformers' own switch, on our classes and the fallback:
the same loss and gradients as without it, in one process and under every strategy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from peft import LoraConfig

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from tests.support.checkpoints import write_checkpoint

IDS = torch.arange(2 * 16).reshape(2, 16) * 5 % 257
KINDS = [("own-llama", False), ("own-qwen3", False), ("llama", True)]


def _loss_and_gradients(
    path: str, force_hf: bool, setup: DistributedSetup | None, checkpointing: bool, lora: bool = False
):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    model = NeMoAutoModelForCausalLM.from_pretrained(
        path, distributed_setup=setup, force_hf=force_hf, peft_config=peft_config
    )
    model.train()
    if checkpointing:
        model.activation_checkpointing_enable()
        assert model.is_gradient_checkpointing
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    loss = model(IDS, labels=IDS).loss
    loss.backward()
    assert len(calls) == (2 if checkpointing else 1)  # checkpointed: the layer runs again in backward
    gradients = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad
        assert (grad is None) == (not parameter.requires_grad), name  # frozen base weights get none
        if grad is not None:
            gradients[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).clone()
    assert gradients and (not lora or all("lora_" in name for name in gradients))
    return float(loss.detach()), gradients


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpointing")
    return {kind: str(write_checkpoint(root / kind, kind, "distinct", tie=False)) for kind, _ in KINDS}


@pytest.mark.parametrize(("kind", "force_hf"), KINDS, ids=[k for k, _ in KINDS])
def test_checkpointing_changes_nothing_in_one_process(checkpoints, kind, force_hf):
    plain = _loss_and_gradients(checkpoints[kind], force_hf, None, checkpointing=False)
    checkpointed = _loss_and_gradients(checkpoints[kind], force_hf, None, checkpointing=True)
    assert checkpointed[0] == plain[0]
    for name, gradient in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], gradient, rtol=0, atol=0)


def case_checkpointing(path: str, force_hf: bool, strategy: str, tp: int, lora: bool = False):
    setup = DistributedSetup.build(strategy, dist.get_world_size(), tp_size=tp)
    plain = _loss_and_gradients(path, force_hf, setup, checkpointing=False, lora=lora)
    checkpointed = _loss_and_gradients(path, force_hf, setup, checkpointing=True, lora=lora)
    assert checkpointed[1].keys() == plain[1].keys()
    differences = [float((checkpointed[1][n] - g).abs().max()) for n, g in plain[1].items()]
    return plain[0], checkpointed[0], max(differences)


@pytest.mark.parametrize(("strategy", "tp"), [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)], ids=["ddp", "fsdp2", "tp2"])
@pytest.mark.parametrize(("kind", "force_hf"), KINDS, ids=[k for k, _ in KINDS])
def test_checkpointing_changes_nothing_on_2_ranks(ranks2, checkpoints, kind, force_hf, strategy, tp):
    for plain_loss, checkpointed_loss, difference in ranks2.run(case_checkpointing, checkpoints[kind], force_hf, strategy, tp):
        assert checkpointed_loss == plain_loss and difference == 0.0


def test_checkpointing_with_lora_changes_nothing_in_one_process(checkpoints):
    """Only the adapters train; the recomputed layers give them the same gradients."""
    plain = _loss_and_gradients(checkpoints["own-llama"], False, None, checkpointing=False, lora=True)
    checkpointed = _loss_and_gradients(checkpoints["own-llama"], False, None, checkpointing=True, lora=True)
    assert checkpointed[0] == plain[0] and checkpointed[1].keys() == plain[1].keys()
    for name, gradient in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], gradient, rtol=0, atol=0)


@pytest.mark.parametrize(("strategy", "tp"), [("fsdp2", 1), ("fsdp2", 2)], ids=["fsdp2", "tp2"])
def test_checkpointing_with_lora_changes_nothing_on_2_ranks(ranks2, checkpoints, strategy, tp):
    for plain_loss, checkpointed_loss, difference in ranks2.run(
        case_checkpointing, checkpoints["own-llama"], False, strategy, tp, True
    ):
        assert checkpointed_loss == plain_loss and difference == 0.0


@pytest.mark.parametrize(("kind", "force_hf"), [KINDS[0], KINDS[2]], ids=["own-llama", "llama"])
def test_checkpointing_changes_nothing_under_fsdp2_x_tp(ranks4, checkpoints, kind, force_hf):
    """4 ranks, fsdp2 over dp=2 of tensor parallel tp=2: fully_shard wraps the checkpointed layers."""
    for plain_loss, checkpointed_loss, difference in ranks4.run(case_checkpointing, checkpoints[kind], force_hf, "fsdp2", 2):
        assert checkpointed_loss == plain_loss and difference == 0.0
