"""Specs for transformers' own classes: what the fallback path adds to them (tensor-parallel plans).

Every causal LM that transformers knows loads through its own class wrapped with the init mixin;
the specs here only add what transformers' classes lack for nemo_wrap's sharding. A class with no
spec here still loads, under every strategy but tensor parallel.
"""

from __future__ import annotations

from nemo_wrap.models.common.parallelize import QK_NORM_MODULES, llama_family_plan
from nemo_wrap.models.spec import ModelSpec

TRANSFORMERS_SPECS = (
    ModelSpec(
        architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        tensor_parallel_plan=llama_family_plan,
    ),
    ModelSpec(
        architectures=("Qwen3ForCausalLM",),
        tensor_parallel_plan=llama_family_plan,
        gradient_sum_modules=QK_NORM_MODULES,
    ),
)
