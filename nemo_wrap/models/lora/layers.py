"""The adapter modules: low-rank pairs added to row blocks of one linear layer's output."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nemo_wrap.models.lora.settings import LoraSettings


class LoraPair(nn.Module):
    """One PEFT adapter: ``lora_B @ lora_A`` (``[out, r] @ [r, in]``), scaled, added to a projection.

    Parameters are named as PEFT's (``lora_A``, ``lora_B``), without its ``.weight``.
    """

    def __init__(self, in_features: int, out_features: int, r: int) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(r, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, r))

    def init_own_parameters(self) -> None:
        """PEFT's default init: A as ``kaiming_uniform_(a=sqrt(5))`` (uniform in ±1/sqrt(in)), B zero,
        so a fresh adapter changes nothing. Run under the init session: seeded and shard-aware."""
        bound = 1.0 / math.sqrt(self.lora_A.shape[1])
        nn.init.uniform_(self.lora_A, -bound, bound)
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lora_A.t()) @ self.lora_B.t()


Placement = tuple[tuple[slice, slice], ...]  # (rows of the pair's output, rows of the layer's output)


class LoraAdapters(nn.Module):
    """The adapters of one linear layer: one :class:`LoraPair` per adapted transformers projection.

    Each pair's output rows land where that projection's rows sit in the layer's output: a fused
    ``qkv_proj`` groups q, k and v rows by key/value head, and our ``gate_up_proj`` interleaves gate
    and up (strided slices). Attached as the layer's ``lora`` child; :func:`add_lora_output` is the
    layer's forward hook.
    """

    def __init__(
        self, in_features: int, out_features: int, parts: Sequence[tuple[str, Placement]], settings: LoraSettings
    ) -> None:
        super().__init__()
        self.out_features = out_features
        self.placements = dict(parts)
        self.pairs = nn.ModuleDict(
            {
                name: LoraPair(in_features, max(rows.stop for rows, _ in placement), settings.r)
                for name, placement in parts
            }
        )
        self.scaling = settings.scaling
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        whole = ((slice(0, self.out_features), slice(0, self.out_features)),)
        if len(self.pairs) == 1 and next(iter(self.placements.values())) == whole:
            return next(iter(self.pairs.values()))(x) * self.scaling
        delta = x.new_zeros(*x.shape[:-1], self.out_features)
        for name, pair in self.pairs.items():
            out = pair(x)
            for pair_rows, layer_rows in self.placements[name]:
                delta[..., layer_rows] = out[..., pair_rows]
        return delta * self.scaling


def _rows_of(placement: Placement) -> int:
    """How many output rows a projection has: its rows' extent (they cover it exactly once)."""
    return max(rows.stop for rows, _ in placement)


def add_lora_output(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """Forward hook of an adapted linear layer: its output plus its adapters' (``module.lora``)."""
    adapters = module.get_submodule("lora")
    return output + adapters(args[0])
