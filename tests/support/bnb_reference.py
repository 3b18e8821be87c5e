"""transformers' own 4-bit model, held to the arithmetic its ``bnb_4bit_compute_dtype`` names.

On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit`` repacks its weights on its first inference
call (eval mode, an input that needs no gradient) and from then on computes in bf16, whatever the
compute dtype: its logits move by ~3e-3 from its own fp32 path (measured on a tiny Mistral). A CPU
without AVX512-BF16 never takes that path. nemo_wrap's 4-bit layers always compute through
``bnb.matmul_4bit`` in the compute dtype, so a reference that is to be compared with them at 1e-5
must too, on every machine.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, BitsAndBytesConfig


def transformers_4bit(base: str | Path, quantization: BitsAndBytesConfig, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, ...)`` with
    bitsandbytes' bf16 inference repacking turned off on each 4-bit layer."""
    import bitsandbytes as bnb

    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, **kwargs)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model
