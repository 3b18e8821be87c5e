"""Tiny configs of 17 transformers causal-LM families, for the "every family loads" table.

Each is written by transformers' own ``save_pretrained`` in the tests, so the checkpoints are in
the layout transformers itself produces: renamed keys (GPT-NeoX ``embed_out``) and per-expert
tensors (Mixtral, Qwen-MoE, DeepSeek-V3, OLMoE) included.
"""

from __future__ import annotations

import transformers

from tests.support.tiny_models import TINY_DECODER

_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_HEAD_DIM = dict(head_dim=16)

FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", _HEAD_DIM),
    "gemma": ("GemmaConfig", _HEAD_DIM),
    "gemma2": ("Gemma2Config", _HEAD_DIM),
    "gemma3_text": ("Gemma3TextConfig", _HEAD_DIM),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "mixtral": ("MixtralConfig", _MOE),
    "qwen3_moe": ("Qwen3MoeConfig", {**_MOE, **_HEAD_DIM}),
    "qwen2_moe": ("Qwen2MoeConfig", {**_MOE, "shared_expert_intermediate_size": 32}),
    "olmoe": ("OlmoeConfig", _MOE),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_MOE,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
}
RENAMED = ("gpt_neox",)


def family_config(family: str):
    config_name, extra = FAMILIES[family]
    return getattr(transformers, config_name)(**{**TINY_DECODER, **extra})


def write_family_checkpoint(family: str, directory, seed: int = 0):
    """transformers' model of ``family`` (seeded, vector parameters perturbed) saved by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family)).eval()
    with torch.no_grad():  # norms start at 1 (or 0) and biases at 0: perturb so their layout matters
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.2)
    model.save_pretrained(directory)
    return model


def tokens():
    import torch

    return torch.randint(4, 257, (2, 10), generator=torch.Generator().manual_seed(1))
