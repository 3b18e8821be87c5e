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


def case_what_stays_gathered(tied: bool, policy: str, prefetch: bool) -> dict[str, dict[str, bool]]:
    """Which FSDP2 groups hold their parameters gathered (a plain tensor registered, not the
    rank's DTensor shard) after a training forward, after its backward, after a forward without
    gradients (generation) and after ``evaluate``;
    and the losses of four steps, which neither the policy nor the prefetch may change."""
    from torch.distributed.tensor import DTensor

    from nemo_wrap.training import evaluate, train_step

    setup = DistributedSetup.build("fsdp2", 2, reshard_after_forward=policy, prefetch=prefetch)
    config = tiny_config("llama", tie_word_embeddings=tied)
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, seed=0)
    ids = torch.arange(16).reshape(2, 8) * 7 % 257

    def gathered() -> dict[str, bool]:
        held = {"layer": model.model.layers[0].self_attn.q_proj.weight, "embedding": model.model.embed_tokens.weight}
        held |= {"norm": model.model.norm.weight, "head": model.lm_head.weight}
        return {name: not isinstance(tensor, DTensor) for name, tensor in held.items()}

    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    states = {"after forward": gathered()}
    loss.backward()
    states["after backward"] = gathered()
    with torch.no_grad():
        model(input_ids=ids)
    states["after a forward without gradients"] = gathered()
    evaluate(model, [{"input_ids": ids, "labels": ids}])
    states["after evaluate"] = gathered()
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = [train_step(model, optimizer, [{"input_ids": ids[i : i + 1]}]).loss for i in range(2) for _ in range(2)]
    return {"states": states, "losses": losses}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_reshard_policy_decides_what_stays_gathered_and_changes_no_loss(ranks2, tied):
    """``layers`` (the default): the layers and an untied embedding reshard after their forward,
    the root (final norm, head; a tied embedding) stays gathered into the backward; ``always``
    reshards everything, ``never`` nothing. A backward, and a forward without gradients
    (``evaluate``, generation), leave nothing gathered.
    Gathering the next layer ahead (``prefetch``, asynchronous on the CPU) changes none of it."""
    runs = {policy: ranks2.run(case_what_stays_gathered, tied, policy, True) for policy in ("layers", "always", "never")}
    runs["layers-no-prefetch"] = ranks2.run(case_what_stays_gathered, tied, "layers", False)
    root = {"norm": True, "head": True}
    expected = {
        "layers": {"layer": False, "embedding": tied, **root},
        "always": {"layer": False, "embedding": False, "norm": False, "head": False},
        "never": {"layer": True, "embedding": True, **root},
    }
    nothing = dict.fromkeys(("layer", "embedding", "norm", "head"), False)
    for policy, per_rank in runs.items():
        for result in per_rank:
            assert result["states"] == {
                "after forward": expected[policy.removesuffix("-no-prefetch")],
                "after backward": nothing,
                "after a forward without gradients": nothing,
                "after evaluate": nothing,
            }, policy
            assert result["losses"] == runs["always"][0]["losses"], policy
