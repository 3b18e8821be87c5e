"""Tiny configs of the causal LMs the suite covers: built in milliseconds, never downloaded."""

from __future__ import annotations

from transformers import (
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

TINY_DECODER = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=3,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(kind: str, **overrides):
    """A 2-layer, 64-wide config of ``kind``; vocab 257 so shards are uneven on 2 and 4 ranks.

    ``own-<kind>`` names the architecture in the config, so nemo_wrap picks its own fused class;
    plain kinds name none, so they take transformers' class.
    """
    if kind.startswith("own-"):
        base = kind.removeprefix("own-")
        architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[base]
        return tiny_config(base, architectures=[architecture], **overrides)
    if kind == "gpt2":
        return GPT2Config(vocab_size=257, n_embd=64, n_layer=2, n_head=4, n_positions=128, pad_token_id=3, bos_token_id=1, eos_token_id=2, **overrides)
    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "gemma2": Gemma2Config,
        "phi3": Phi3Config,
    }
    extra = {"head_dim": 16} if kind in ("qwen3", "gemma2") else {}
    return classes[kind](**{**TINY_DECODER, **extra, **overrides})


ALL_KINDS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt2")
TENSOR_PARALLEL_KINDS = ("llama", "qwen2", "qwen3", "mistral")
OWN_KINDS = ("own-llama", "own-qwen2", "own-qwen3")
