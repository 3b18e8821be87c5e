"""Llama checkpoints ↔ ``NeMoLlamaForCausalLM``: only the fused projections and the tied head differ."""

from __future__ import annotations

from nemo_wrap.models.common.state_dict_adapter import StateDictAdapter


class LlamaStateDictAdapter(StateDictAdapter):
    """The shared adapter as is: Llama adds no keys beyond the common decoder's.

    Optional ``attention_bias``/``mlp_bias`` biases follow the same fused layouts as the weights.
    """
