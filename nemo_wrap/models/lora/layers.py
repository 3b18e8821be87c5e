"""The adapter modules: low-rank pairs added to row blocks of one linear layer's output.

The adapters of a layer ``qkv_proj`` live in its sibling ``lora_qkv_proj`` (not inside the layer:
tensor parallel's column-wise style re-registers every parameter under the layer it shards) and are
added to the layer's output by a forward hook. Under tensor parallel that hook sees the layer's
output as a DTensor before it is made local — column-sharded for a column-wise layer, a partial sum
for a row-wise one — and adds an adapter output of the same layout, computed from this rank's rows
(or input columns) only. The adapter parameters stay whole on every tp rank, their gradients
summed over the tp ranks (each rank's is a partial sum), like Qwen3's q/k norms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from nemo_wrap.errors import ShardingError
from nemo_wrap.models.lora.settings import PairShape

Placement = tuple[tuple[slice, slice], ...]  # (rows of the pair's output, rows of the layer's output)


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

    def forward(self, x: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
        """The down-projection ``x @ A[:, columns]^T`` (all input columns, or one tp rank's); the
        layer's :class:`LoraAdapters` applies every pair's ``B`` in one product."""
        return x @ self.lora_A[:, columns].t()


class LoraAdapters(nn.Module):
    """The adapters of one linear layer: one :class:`LoraPair` per adapted transformers projection.

    Each pair's output rows land where that projection's rows sit in the layer's output: a fused
    ``qkv_proj`` groups q, k and v rows by key/value head, and our ``gate_up_proj`` interleaves gate
    and up (strided slices).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parts: Sequence[tuple[str, Placement]],
        shapes: Mapping[str, PairShape],
        dropout: float,
    ) -> None:
        """``parts``: each projection's short name and rows; ``shapes``: each one's rank and scale."""
        super().__init__()
        self.out_features = out_features
        self.placements = dict(parts)
        self.pairs = nn.ModuleDict(
            {name: LoraPair(in_features, _rows_of(placement), shapes[name].r) for name, placement in parts}
        )
        self.scalings = {name: shapes[name].scaling for name, _ in parts}
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output for the whole layer."""
        return self._delta(self.dropout(x), self.out_features, self.placements)

    def sharded(self, x: DTensor, output: DTensor) -> DTensor:
        """This rank's share of the adapters' output, in the layout of the layer's sharded ``output``."""
        mesh, placement = output.device_mesh, output.placements[0]
        rank = mesh.get_local_rank()
        if isinstance(placement, Partial):  # row-wise layer: this rank's input columns, all output rows
            local = x.to_local()
            columns = slice(rank * local.shape[-1], (rank + 1) * local.shape[-1])
            delta = self._delta(self.dropout(local), self.out_features, self.placements, columns=columns)
        elif isinstance(placement, Shard):  # column-wise layer: the whole input, this rank's output rows
            local_out = output.to_local().shape[-1]
            placements = {name: _first_chunk(p, local_out) for name, p in self.placements.items()}
            local = x.to_local(grad_placements=[Partial()])  # each rank's input gradient is a partial sum
            delta = self._delta(self.dropout(local), local_out, placements, chunk=rank)
        else:
            raise ShardingError(f"LoRA on a layer whose output is {placement}: not a column- or row-wise layer")
        return DTensor.from_local(delta, mesh, output.placements, run_check=False)

    def _delta(
        self,
        x: torch.Tensor,
        rows: int,
        placements: dict[str, Placement],
        columns: slice = slice(None),
        chunk: int | None = None,
    ) -> torch.Tensor:
        """``(x @ A^T) @ (scaling · B)^T`` over every pair at once: the pairs' down-projections side
        by side (each of its own rank), times one ``B`` matrix that holds each pair's scaled rows (its
        ``chunk`` of them under column-wise tp) at its projection's rows of the layer — two matrix
        products, no scatter of activations."""
        down = torch.cat([pair(x, columns=columns) for pair in self.pairs.values()], dim=-1)
        return down @ self._placed_b(rows, placements, chunk).t()

    def _placed_b(self, rows: int, placements: dict[str, Placement], chunk: int | None) -> torch.Tensor:
        blocks: list[torch.Tensor] = []
        for name, pair in self.pairs.items():
            b: torch.Tensor = pair.get_parameter("lora_B") * self.scalings[name]
            if chunk is not None:  # this rank's rows of the projection: chunk ``chunk`` of equal ones
                size = _rows_of(placements[name])
                b = b[chunk * size : (chunk + 1) * size]
            if placements[name] == ((slice(0, rows), slice(0, rows)),):
                blocks.append(b)  # the projection is the whole layer
                continue
            placed = b.new_zeros(rows, b.shape[1])
            for pair_rows, layer_rows in placements[name]:
                placed[layer_rows] = b[pair_rows]
            blocks.append(placed)
        return torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]


def _rows_of(placement: Placement) -> int:
    """How many output rows a projection has: its rows' extent (they cover it exactly once)."""
    return max(rows.stop for rows, _ in placement)


def _first_chunk(placement: Placement, layer_rows: int) -> Placement:
    """The part of ``placement`` inside the layer's first ``layer_rows`` rows: every tp rank's rows
    follow the same pattern (whole heads, kv groups and gate/up pairs per rank), shifted."""
    chunk = []
    for pair_rows, rows in placement:
        count = len(range(rows.start, min(rows.stop, layer_rows), rows.step or 1))
        if count > 0:
            step = rows.step or 1
            chunk.append(
                (slice(pair_rows.start, pair_rows.start + count), slice(rows.start, rows.start + count * step, step))
            )
    return tuple(chunk)


def add_lora_output(adapters: LoraAdapters, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
    """Forward hook of an adapted linear layer (bound to its ``adapters``): its output plus theirs,
    computed in the adapters' dtype (float32 beside a 4-bit layer, as PEFT does) and added in the
    output's."""
    x = args[0]
    if isinstance(output, DTensor) and isinstance(x, DTensor):
        return output + adapters.sharded(x, output)
    return output + adapters(x.to(adapters.dtype)).to(output.dtype)
