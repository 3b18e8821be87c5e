"""Which linear layers are held in 4 bits — transformers' rule — and swapping them on the meta model.

transformers quantizes every ``nn.Linear`` (and GPT-2's ``Conv1D``) except the modules
``HfQuantizer.get_modules_to_not_convert`` names: by default the output layer, tied weights and the
last module, or ``llm_int8_skip_modules`` instead, plus the class's ``_keep_in_fp32_modules``;
names match by transformers' ``should_convert_module``. The same functions decide here. Our fused
layers answer for the transformers projections they hold (``qkv_proj`` for ``q_proj``, ``k_proj``
and ``v_proj``): quantized when all of them would be, refused when only some would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from nemo_wrap.errors import UnsupportedQuantizationError, summarize
from nemo_wrap.models.lora.layers import Placement
from nemo_wrap.models.quantized.linear import QuantizedLinear
from nemo_wrap.models.quantized.settings import BLOCK_SIZE, QuantizationSettings


def quantize_linear_layers(
    model: PreTrainedModel,
    settings: QuantizationSettings,
    fused: Mapping[str, Sequence[tuple[str, Placement]]],
    weight_dtype: torch.dtype,
) -> list[str]:
    """Replace each linear layer transformers would quantize with a :class:`QuantizedLinear` (on
    meta: nothing is allocated) and return their names. ``fused``: our fused layers' names → the
    transformers projections each holds, with where their rows sit."""
    keep_in_fp32 = model._keep_in_fp32_modules
    skip = HfQuantizer.get_modules_to_not_convert(
        model,
        None if settings.skip_modules is None else list(settings.skip_modules),
        None if keep_in_fp32 is None else list(keep_in_fp32),
    )
    chosen = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and _is_quantized(name, module, skip, fused)
    }
    _refuse_unquantizable(model, chosen)
    for name, layer in chosen.items():
        parent_name, _, leaf = name.rpartition(".")
        with torch.device("meta"):
            parts = [rows for _, rows in fused.get(name, ())]
            quantized = QuantizedLinear(
                layer.in_features, layer.out_features, layer.bias is not None, settings, weight_dtype, parts
            )
        model.get_submodule(parent_name).add_module(leaf, quantized)
    return list(chosen)


def _is_quantized(
    name: str, module: nn.Linear, skip: list[str], fused: Mapping[str, Sequence[tuple[str, Placement]]]
) -> bool:
    if type(module) is not nn.Linear:  # not subclasses: PEFT's views, others' layers
        return False
    parts = [part for part, _ in fused.get(name, ())] or [name]
    converted = [should_convert_module(part, skip) for part in parts]
    if any(converted) and not all(converted):
        kept = [part for part, quantized in zip(parts, converted, strict=True) if not quantized]
        raise UnsupportedQuantizationError(
            f"llm_int8_skip_modules keeps {kept} unquantized, but {name} holds them fused with "
            f"{[p for p in parts if p not in kept]}: skip all of them or none (or pass force_hf=True)"
        )
    return all(converted)


def _refuse_unquantizable(model: PreTrainedModel, layers: dict[str, nn.Linear]) -> None:
    """transformers would quantize GPT-2's ``Conv1D`` too (refused: its weight is transposed); a
    tied weight (one tensor in two layers) cannot be 4-bit in one of them; and bitsandbytes' blocks
    of 64 values must not cross rows, or no rank could quantize its rows alone."""
    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            raise UnsupportedQuantizationError(
                f"{name} is a transformers Conv1D (GPT-2 style): nemo_wrap quantizes nn.Linear layers only"
            )
    ties = model.all_tied_weights_keys
    tied = [n for n in layers if f"{n}.weight" in ties or f"{n}.weight" in ties.values()]
    if tied:
        raise UnsupportedQuantizationError(
            f"{summarize(tied)} share their weight with another layer (tied): keep them unquantized "
            "(llm_int8_skip_modules, or leave it unset for transformers' default)"
        )
    odd = [
        f"{name} (in_features={layer.in_features})" for name, layer in layers.items() if layer.in_features % BLOCK_SIZE
    ]
    if odd:
        raise UnsupportedQuantizationError(
            f"{len(odd)} linear layer(s) have in_features that are no multiple of {BLOCK_SIZE}, so bitsandbytes' "
            f"blocks would cross rows: {summarize(odd)}; keep them unquantized with llm_int8_skip_modules"
        )
