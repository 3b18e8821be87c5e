"""Registering an architecture from outside the package: one ``ModelSpec``, no edit to nemo_wrap.

The test gives transformers' ``GemmaForCausalLM`` a plan of its own through a spec registered in
each rank's process (it wins over the plan transformers declares), loads a seeded Gemma checkpoint
under fsdp2 with tp=2 on 2 gloo ranks, and compares the logits with transformers' own class in one
process.
"""

from __future__ import annotations

import torch

from nemo_wrap import MODEL_ARCH_MAPPING, DistributedSetup, ModelSpec, register_architecture
from nemo_wrap.auto import NeMoAutoModelForCausalLM


def _gemma_config():
    from transformers import GemmaConfig

    return GemmaConfig(
        vocab_size=257,  # odd: the vocab-parallel embedding and lm_head shard unevenly
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        pad_token_id=3,
        architectures=["GemmaForCausalLM"],
    )


def _gemma_plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.*"
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        **{f"{layer}.self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        **{f"{layer}.mlp.{name}": ColwiseParallel() for name in ("gate_proj", "up_proj")},
        f"{layer}.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


GEMMA_SPEC = ModelSpec(architectures=("GemmaForCausalLM",), tensor_parallel_plan=_gemma_plan)


def _write_gemma_checkpoint(directory) -> None:
    from transformers import GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(_gemma_config())
    with torch.no_grad():  # Gemma's norms start at 0 (weight 1 + w): perturb so their layout matters
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter), alpha=0.2)
    model.save_pretrained(directory)


def _tokens() -> torch.Tensor:
    return torch.randint(4, 257, (2, 12), generator=torch.Generator().manual_seed(1))


def case_registered_gemma_under_fsdp2_tp2(checkpoint: str) -> dict:
    from torch.distributed.tensor import DTensor
    from transformers import GemmaForCausalLM

    register_architecture(GEMMA_SPEC)
    try:
        setup = DistributedSetup.build("fsdp2", 2, tp_size=2)
        model = NeMoAutoModelForCausalLM.from_pretrained(checkpoint, distributed_setup=setup, verify=True).eval()
        reference = GemmaForCausalLM.from_pretrained(checkpoint).eval()
        with torch.no_grad():
            actual, expected = model(_tokens()).logits, reference(_tokens()).logits
        return {
            "logits_error": (actual - expected).abs().max().item(),
            "spec": type(model).model_spec == GEMMA_SPEC,
            "embedding_sharded": isinstance(model.model.embed_tokens.weight, DTensor),
            "q_proj_rows": model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0],
            "tied": model.lm_head.weight is model.model.embed_tokens.weight,
            "verified": model.load_report.verified,
        }
    finally:
        MODEL_ARCH_MAPPING.remove(GEMMA_SPEC)


def test_a_registered_spec_wins_over_the_plan_transformers_declares():
    from nemo_wrap.models.declared_plans import DeclaredPlan

    config = _gemma_config()
    declared = NeMoAutoModelForCausalLM.model_class(config).model_spec
    assert declared.tensor_parallel_plan == DeclaredPlan(declared_class(config))
    register_architecture(GEMMA_SPEC)
    try:
        assert NeMoAutoModelForCausalLM.model_class(config).model_spec is GEMMA_SPEC
    finally:
        MODEL_ARCH_MAPPING.remove(GEMMA_SPEC)
    assert NeMoAutoModelForCausalLM.model_class(config).model_spec == declared


def declared_class(config):
    from transformers import GemmaForCausalLM

    assert type(config).__name__ == "GemmaConfig"
    return GemmaForCausalLM


def test_registered_gemma_loads_under_fsdp2_tp2_with_transformers_logits(ranks2, tmp_path):
    _write_gemma_checkpoint(tmp_path)
    for rank, result in enumerate(ranks2.run(case_registered_gemma_under_fsdp2_tp2, str(tmp_path))):
        assert result["logits_error"] <= 1e-5, (rank, result)
        assert result["spec"] and result["embedding_sharded"] and result["tied"], (rank, result)
        assert result["q_proj_rows"] == 4 * 16 // 2, rank  # half of the 4 query heads of 16
        assert result["verified"] is True, rank
    assert GEMMA_SPEC not in MODEL_ARCH_MAPPING  # registered in the ranks' processes only
