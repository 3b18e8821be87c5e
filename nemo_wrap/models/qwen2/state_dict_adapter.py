"""Qwen2 checkpoints ↔ ``NeMoQwen2ForCausalLM``: only the fused projections and the tied head differ."""

from __future__ import annotations

from nemo_wrap.models.common.state_dict_adapter import StateDictAdapter


class Qwen2StateDictAdapter(StateDictAdapter):
    """The shared adapter as is: Qwen2's q/k/v biases fuse into ``qkv_proj.bias`` in the weight's layout."""
