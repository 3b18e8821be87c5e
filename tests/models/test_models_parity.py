"""Our fused models against transformers' own, on the same weights, in fp32.

Each case builds transformers' model from a seed, saves it with ``save_pretrained``, loads it into
ours with ``NeMoAutoModelForCausalLM.from_pretrained``, and compares logits under left padding (atol 1e-5) and 20
greedily generated tokens (KV cache on). Saving ours and loading with ``AutoModelForCausalLM``
closes the loop; loss and gradients are compared through the adapter.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.models.llama import NeMoLlamaForCausalLM
from nemo_wrap.models.qwen2 import NeMoQwen2ForCausalLM
from nemo_wrap.models.qwen3 import NeMoQwen3ForCausalLM

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, NeMoLlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, NeMoQwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, NeMoQwen3ForCausalLM),
}
VOCAB = 96
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_config(arch: str, *, kv_heads: int, tied: bool, **overrides):
    config_class = ARCHITECTURES[arch][0]
    values = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3":
        values["head_dim"] = 24  # Qwen3's head_dim is its own field, not hidden_size // heads
    values.update(overrides)
    return config_class(**values)


def hf_and_ours(arch: str, config, tmp_path, seed: int = 0):
    """transformers' model (seeded init) and ours loaded from its saved checkpoint, both in eval mode."""
    torch.manual_seed(seed)
    hf = ARCHITECTURES[arch][1](config).eval()
    with torch.no_grad():
        # transformers initializes biases to 0 and norm weights to 1, which would hide a wrong
        # bias layout or swapped q/k norms: perturb every vector parameter.
        for parameter in hf.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.2)
    hf.save_pretrained(tmp_path / "hf")
    ours = NeMoAutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(ours) is NeMoAutoModelForCausalLM.model_class(config)  # one cached class per architecture
    assert issubclass(type(ours), ARCHITECTURES[arch][2])  # the mapping picked our fused class
    return hf, ours


def left_padded_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (3, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0
    attention_mask[2, :1] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def assert_same_logits_and_generation(hf, ours, **generate_kwargs) -> None:
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = hf(input_ids, attention_mask=attention_mask).logits
        actual = ours(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=1e-5, rtol=0)
    settings = dict(attention_mask=attention_mask, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    settings.update(generate_kwargs)
    expected_tokens = hf.generate(input_ids, **settings)
    actual_tokens = ours.generate(input_ids, **settings)
    assert actual_tokens.shape == (3, 31)
    assert torch.equal(actual_tokens, expected_tokens)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_and_greedy_generation_match_transformers(arch, kv_heads, tied, tmp_path):
    hf, ours = hf_and_ours(arch, make_config(arch, kv_heads=kv_heads, tied=tied), tmp_path)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    assert_same_logits_and_generation(hf, ours)


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    config = make_config("llama", kv_heads=2, tied=False, rope_parameters=dict(LLAMA3_ROPE))
    hf, ours = hf_and_ours("llama", config, tmp_path)
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq, atol=0, rtol=0)
    assert_same_logits_and_generation(hf, ours)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_sliding_window_layers_match_transformers(arch, tmp_path):
    config = make_config(arch, kv_heads=2, tied=False, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    assert_same_logits_and_generation(*hf_and_ours(arch, config, tmp_path))


@pytest.mark.parametrize(
    ("arch", "sliding"), [("llama", False), ("qwen2", True)], ids=["one-mask", "mask-per-layer-type"]
)
def test_static_cache_generation_matches_transformers(arch, sliding, tmp_path):
    """With a compileable cache, ``generate`` builds the 4-D masks itself (a dict for Qwen's layer types)."""
    overrides = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1) if sliding else {}
    config = make_config(arch, kv_heads=2, tied=False, **overrides)
    assert_same_logits_and_generation(*hf_and_ours(arch, config, tmp_path), cache_implementation="static")


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_loss_and_gradients_match_transformers(arch, tmp_path):
    biases = {"attention_bias": True, "mlp_bias": True} if arch == "llama" else {}
    hf, ours = hf_and_ours(arch, make_config(arch, kv_heads=2, tied=True, **biases), tmp_path)
    input_ids, attention_mask = left_padded_batch()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    expected = hf(input_ids, attention_mask=attention_mask, labels=labels).loss
    actual = ours(input_ids, attention_mask=attention_mask, labels=labels).loss
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0)
    expected.backward()
    actual.backward()
    ours_grads = {name: p.grad for name, p in ours.named_parameters(remove_duplicate=False)}
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    mapped = ours.state_dict_adapter().to_hf(ours_grads)
    assert set(mapped) == set(hf_grads)
    for name, grad in mapped.items():
        torch.testing.assert_close(grad, hf_grads[name], atol=1e-5, rtol=0, msg=name)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tmp_path):
    _, ours = hf_and_ours("llama", make_config("llama", kv_heads=2, tied=False), tmp_path)
    input_ids, attention_mask = left_padded_batch()
    ours.train()
    plain = ours(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    plain.backward()
    plain_grads = {name: p.grad.clone() for name, p in ours.named_parameters()}
    ours.zero_grad()
    ours.activation_checkpointing_enable()
    checkpointed = ours(input_ids, attention_mask=attention_mask, labels=input_ids)
    checkpointed.loss.backward()
    assert checkpointed.cache is None
    torch.testing.assert_close(checkpointed.loss, plain, atol=0, rtol=0)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_save_pretrained_loads_in_transformers(arch, tied, tmp_path):
    hf, ours = hf_and_ours(arch, make_config(arch, kv_heads=2, tied=tied), tmp_path)
    # torch's fully_shard / replicate rename the class; the written architecture must not change.
    ours.__class__ = type(f"FSDP{type(ours).__name__}", (type(ours),), {})
    ours.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURES[arch][1].__name__]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(reloaded) is ARCHITECTURES[arch][1]
    for name, tensor in hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = reloaded(input_ids, attention_mask=attention_mask).logits
        actual = ours(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=1e-5, rtol=0)
