"""Rotary position embeddings: the default schedule and Llama 3's frequency scaling.

Only the static schedules are implemented: their inverse frequencies depend on the config alone,
so they are a plain, recomputable buffer. Any other ``rope_type`` is refused when the model is
built rather than silently run with unscaled frequencies.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PreTrainedConfig

from nemo_wrap.errors import UnsupportedModelConfigError
from nemo_wrap.models.common.layouts import head_dim

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_inverse_frequencies(config: PreTrainedConfig) -> torch.Tensor:
    """The ``head_dim // 2`` inverse frequencies ``1 / theta^(2i / head_dim)``, scaled per ``rope_type``."""
    parameters = config.rope_parameters
    rope_type = parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelConfigError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelConfigError(
            f"rope_parameters['partial_rotary_factor']={parameters['partial_rotary_factor']} is not supported; "
            "only full rotary embeddings (1.0) are"
        )
    dim = head_dim(config)
    inv_freq = 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, parameters)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, parameters: dict) -> torch.Tensor:
    """Llama 3.1's context extension: slow down low frequencies by ``factor``, keep high ones.

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``; shorter than ``.../high_freq_factor`` are kept; in between, the two are blended
    linearly in ``original_max_position_embeddings / wavelength``.
    """
    factor = parameters["factor"]
    low_freq_factor = parameters["low_freq_factor"]
    high_freq_factor = parameters["high_freq_factor"]
    original_context = parameters["original_max_position_embeddings"]

    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = original_context / low_freq_factor
    high_freq_wavelength = original_context / high_freq_factor

    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Turns position ids into the ``(cos, sin)`` pair that :func:`apply_rotary` consumes.

    ``inv_freq`` is a non-persistent buffer (never in checkpoints); after building on the meta
    device or ``to_empty`` it holds no values, so the model's init rule recomputes it from the config.
    """

    inv_freq: torch.Tensor  # registered as a buffer in ``__init__``

    def __init__(self, config: PreTrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids (batch, seq)`` → ``cos, sin (batch, seq, head_dim)``, computed in float32."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query``/``key`` of shape ``(batch, heads, seq, head_dim)`` (half-split convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin
