"""4-bit base weights for QLoRA: bitsandbytes' quantization, stored so that each rank holds rows.

- :mod:`.settings`: what of transformers' ``BitsAndBytesConfig`` is honoured (the rest is refused).
- :mod:`.linear`: ``QuantizedLinear``, the 4-bit layer (bitsandbytes' bytes and ``matmul_4bit``).
- :mod:`.layers`: which layers are quantized (transformers' rule) and the swap on the meta model.
- :mod:`.engine`: bitsandbytes, imported on first use (the optional ``qlora`` extra).
"""

from nemo_wrap.models.quantized.engine import check_bitsandbytes_installed
from nemo_wrap.models.quantized.layers import quantize_linear_layers
from nemo_wrap.models.quantized.linear import QuantizedLinear
from nemo_wrap.models.quantized.settings import QuantizationSettings, quantization_settings

__all__ = [
    "QuantizationSettings",
    "QuantizedLinear",
    "check_bitsandbytes_installed",
    "quantization_settings",
    "quantize_linear_layers",
]
