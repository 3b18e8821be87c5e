"""Qwen3 checkpoints ↔ ``NeMoQwen3ForCausalLM``: only the fused projections and the tied head differ."""

from __future__ import annotations

from nemo_wrap.models.common.state_dict_adapter import StateDictAdapter


class Qwen3StateDictAdapter(StateDictAdapter):
    """The shared adapter as is: Qwen3's ``q_norm``/``k_norm`` weights keep their names and shapes."""
