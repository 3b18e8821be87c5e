"""Sharding managers: the model stays the model; what cannot be sharded fails at build."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.errors import ShardingError
from nemo_wrap.initialization import NeMoPreTrainedModel
from tests.support.tiny_models import tiny_config


def case_model_stays_the_model(kind: str, strategy: str, tp_size: int):
    setup = DistributedSetup.build(strategy, 2, tp_size=tp_size)
    model = NeMoAutoModelForCausalLM.from_config(tiny_config(kind), distributed_setup=setup, seed=0)
    transformers_class = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[kind]
    return dict(
        is_transformers_class=isinstance(model, transformers_class),
        is_pretrained=isinstance(model, PreTrainedModel),
        is_nemo=isinstance(model, NeMoPreTrainedModel),
        can_generate=isinstance(model, GenerationMixin) and callable(model.save_pretrained),
        config_type=type(model.config).__name__,
        setup_recorded=model.nemo_state.setup == setup,
    )


@pytest.mark.parametrize(("strategy", "tp_size"), [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)], ids=["ddp", "fsdp2", "tp2"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_model_stays_the_model(ranks2, kind, strategy, tp_size):
    for facts in ranks2.run(case_model_stays_the_model, kind, strategy, tp_size):
        assert facts == dict(
            is_transformers_class=True,
            is_pretrained=True,
            is_nemo=True,
            can_generate=True,
            config_type=f"{kind.capitalize()}Config" if kind == "llama" else "Qwen2Config",
            setup_recorded=True,
        )


def test_model_without_a_plan_fails_at_build_before_any_collective():
    """No process group exists here: the check must come first, and name the way out."""
    setup = DistributedSetup.build("fsdp2", 2, tp_size=2)
    with pytest.raises(ShardingError) as excinfo:
        NeMoAutoModelForCausalLM.from_config(tiny_config("gpt2"), distributed_setup=setup)
    message = str(excinfo.value)
    assert "GPT2LMHeadModel" in message and "no tensor-parallel plan" in message and "tp_size=1" in message


def test_heads_not_divisible_by_tp_size_fail_at_build():
    setup = DistributedSetup.build("fsdp2", 4, tp_size=4)
    with pytest.raises(ShardingError, match="num_key_value_heads=2, tp_size=4"):
        NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), distributed_setup=setup)


def case_generate_when_ranks_stop_at_different_steps(strategy: str, tp_size: int):
    """Rank 0's EOS is its first greedy token (it stops at once); rank 1 has no EOS and runs on."""
    import torch.distributed as dist

    setup = DistributedSetup.build(strategy, 2, tp_size=tp_size)
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), distributed_setup=setup, seed=0)
    prompt = torch.tensor([[5, 6, 7, 8]])
    first = model.generate(prompt, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=3)[0, -1].item()
    eos = first if dist.get_rank() == 0 else None
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=3)
    return out.shape[-1] - prompt.shape[-1]


@pytest.mark.parametrize(("strategy", "tp_size"), [("ddp", 1), ("fsdp2", 1), ("fsdp2", 2)], ids=["ddp", "fsdp2", "tp2"])
def test_generate_does_not_hang_when_ranks_stop_at_different_steps(ranks2, strategy, tp_size):
    new_tokens = ranks2.run(case_generate_when_ranks_stop_at_different_steps, strategy, tp_size, timeout=60)
    assert new_tokens[0] <= new_tokens[1] == 6  # rank 0 stopped early (padded), rank 1 ran to the end
