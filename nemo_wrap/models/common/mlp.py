"""The gated feed-forward block ``down(act(gate(x)) * up(x))`` with one fused gate/up matmul."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from nemo_wrap.models.common.layouts import GateUpLayout


class GatedMLP(nn.Module):
    """SwiGLU-style MLP; ``gate_up_proj`` uses the row-interleaved :class:`GateUpLayout`.

    The forward splits gate from up by row parity, so it works on the full weight and on any
    ``Shard(0)`` chunk of it under tensor parallelism.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, *, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = GateUpLayout.split_activations(self.gate_up_proj(hidden_states))
        return self.down_proj(self.act_fn(gate) * up)
