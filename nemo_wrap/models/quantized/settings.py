"""What of transformers' ``BitsAndBytesConfig`` nemo_wrap honours; anything else is refused by name.

The request is transformers' own: ``quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", ...)``. It becomes one frozen :class:`QuantizationSettings`, printed in
the load plan, before anything is built: a setting that would be dropped (8-bit, a storage dtype
meant for FSDP1's flat parameters, CPU offload) raises here instead of loading something else than
was asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import BitsAndBytesConfig

from nemo_wrap.errors import UnsupportedQuantizationError

QUANT_TYPES = ("nf4", "fp4")
# Degrees a 4-bit load refuses, and why: its layers hold whole rows, and the rest is not built yet.
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZE = 64  # bitsandbytes' 4-bit block, the one transformers uses
STATISTICS_BLOCK_SIZE = 256  # bitsandbytes' block for the double-quantized absmax


@dataclass(frozen=True)
class QuantizationSettings:
    """How linear layers are held in 4 bits (bitsandbytes), from a ``BitsAndBytesConfig``.

    ``skip_modules`` is ``llm_int8_skip_modules``: ``None`` keeps transformers' default (the output
    layer, tied weights and the last module stay unquantized); a list replaces that default, as it
    does in transformers.
    """

    quant_type: str
    compute_dtype: torch.dtype
    double_quant: bool
    skip_modules: tuple[str, ...] | None = None

    def __str__(self) -> str:
        statistics = "double-quantized absmax (8 bits, blocks of 256)" if self.double_quant else "fp32 absmax"
        skipped = (
            "transformers' default" if self.skip_modules is None else f"llm_int8_skip_modules={list(self.skip_modules)}"
        )
        return (
            f"bitsandbytes 4-bit {self.quant_type.upper()}, blocks of {BLOCK_SIZE} with {statistics}, "
            f"compute in {str(self.compute_dtype).removeprefix('torch.')}; not quantized: {skipped}"
        )


def quantization_settings(config: object) -> QuantizationSettings:
    """Validate ``config`` (a ``transformers.BitsAndBytesConfig`` asking for 4 bits) and return the
    settings the quantized layers use."""
    if not isinstance(config, BitsAndBytesConfig):
        raise UnsupportedQuantizationError(
            f"quantization_config must be a transformers.BitsAndBytesConfig(load_in_4bit=True, ...), "
            f"got {type(config).__name__}: nemo_wrap quantizes with bitsandbytes only"
        )
    if config.load_in_8bit or not config.load_in_4bit:
        raise UnsupportedQuantizationError(
            "BitsAndBytesConfig: nemo_wrap quantizes to 4 bits only (load_in_4bit=True); load_in_8bit is not supported"
        )
    if config.bnb_4bit_quant_type not in QUANT_TYPES:
        raise UnsupportedQuantizationError(
            f"BitsAndBytesConfig.bnb_4bit_quant_type={config.bnb_4bit_quant_type!r}: use one of {list(QUANT_TYPES)}"
        )
    if config.bnb_4bit_quant_storage != torch.uint8:
        raise UnsupportedQuantizationError(
            f"BitsAndBytesConfig.bnb_4bit_quant_storage={config.bnb_4bit_quant_storage}: nemo_wrap stores the 4-bit "
            "values as uint8 rows, which FSDP2 shards as they are (other storage dtypes exist for FSDP1); use uint8"
        )
    if config.llm_int8_enable_fp32_cpu_offload:
        raise UnsupportedQuantizationError(
            "BitsAndBytesConfig.llm_int8_enable_fp32_cpu_offload=True: nemo_wrap places whole models, no device map"
        )
    if config.bnb_4bit_compute_dtype not in COMPUTE_DTYPES:
        raise UnsupportedQuantizationError(
            f"BitsAndBytesConfig.bnb_4bit_compute_dtype={config.bnb_4bit_compute_dtype}: use one of "
            f"{[str(d) for d in COMPUTE_DTYPES]}"
        )
    skip = config.llm_int8_skip_modules
    return QuantizationSettings(
        config.bnb_4bit_quant_type,
        config.bnb_4bit_compute_dtype,
        bool(config.bnb_4bit_use_double_quant),
        None if skip is None else tuple(skip),
    )
