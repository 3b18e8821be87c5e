"""The adapter modules: low-rank pairs added to row blocks of one linear layer's output.

The adapters of a layer ``qkv_proj`` live in its sibling ``lora_qkv_proj`` (not inside the layer:
tensor parallel's column-wise style re-registers every parameter under the layer it shards) and are
added to the layer's output by a forward hook. Under tensor parallel that hook sees the layer's
output as a DTensor before it is made local — column-sharded for a column-wise layer, a partial sum
for a row-wise one — and adds an adapter output of the same layout, computed from this rank's rows
(or input columns) only. The adapter parameters stay whole on every tp rank, their gradients
summed over the tp ranks (each rank's is a partial sum), like Qwen3's q/k norms.

PEFT's options beyond plain LoRA live here too: ``lora_bias`` (a bias on ``lora_B``, scaled with
it) and DoRA's magnitude vector (its arithmetic is :mod:`nemo_wrap.models.lora.dora`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from nemo_wrap.errors import ShardingError
from nemo_wrap.models.lora.settings import PairShape

Placement = tuple[tuple[slice, slice], ...]  # (rows of the pair's output, rows of the layer's output)


class LoraPair(nn.Module):
    """One PEFT adapter: ``lora_B @ lora_A`` (``[out, r] @ [r, in]``), scaled, added to a projection.

    Parameters are named as PEFT's (``lora_A``, ``lora_B``), without its ``.weight``; with
    ``lora_bias`` also PEFT's ``lora_B.bias`` (``lora_bias``), with DoRA its
    ``lora_magnitude_vector`` (``lora_magnitude``).
    """

    def __init__(self, in_features: int, out_features: int, r: int, bias: bool = False, dora: bool = False) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(r, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, r))
        self.lora_bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora_magnitude = nn.Parameter(torch.empty(out_features)) if dora else None

    def init_own_parameters(self) -> None:
        """PEFT's default init: A as ``kaiming_uniform_(a=sqrt(5))`` (uniform in ±1/sqrt(in)), B and
        its bias zero, so a fresh adapter changes nothing. Run under the init session: seeded and
        shard-aware. DoRA's magnitude is the adapted weight's row norms: it is set once the base
        weights are in place (:func:`nemo_wrap.models.lora.dora.initialize_magnitudes`); ones until then."""
        bound = 1.0 / math.sqrt(self.lora_A.shape[1])
        nn.init.uniform_(self.lora_A, -bound, bound)
        nn.init.zeros_(self.lora_B)
        if self.lora_bias is not None:
            nn.init.zeros_(self.lora_bias)
        if self.lora_magnitude is not None:
            nn.init.ones_(self.lora_magnitude)

    def forward(self, x: torch.Tensor, columns: slice = slice(None)) -> torch.Tensor:
        """The down-projection ``x @ A[:, columns]^T`` (all input columns, or one tp rank's); the
        layer's :class:`LoraAdapters` applies every pair's ``B`` in one product."""
        return x @ self.lora_A[:, columns].t()


@dataclass(frozen=True)
class LocalRows:
    """Which rows of the layer's output this rank computes, and each pair's share of them.

    ``count`` output rows; ``placements`` of the pairs within them; ``chunk``: under column-wise
    tensor parallel, the index of this rank's equal chunk of every pair's rows (``None``: all rows);
    ``columns``: under row-wise tensor parallel, this rank's input columns, and ``shares`` the
    number of ranks whose outputs are summed.
    """

    count: int
    placements: dict[str, Placement]
    chunk: int | None = None
    columns: slice = field(default_factory=lambda: slice(None))
    shares: int = 1

    def pair_rows(self, name: str, size: int) -> slice:
        """The rows of pair ``name`` (``size`` rows in all) that this rank computes."""
        if self.chunk is None:
            return slice(0, size)
        per_rank = _rows_of(self.placements[name])
        return slice(self.chunk * per_rank, (self.chunk + 1) * per_rank)


class LoraAdapters(nn.Module):
    """The adapters of one linear layer: one :class:`LoraPair` per adapted transformers projection.

    Each pair's output rows land where that projection's rows sit in the layer's output: a fused
    ``qkv_proj`` groups q, k and v rows by key/value head, and our ``gate_up_proj`` interleaves gate
    and up (strided slices). The hook hands them dropped-out inputs (one mask, shared with DoRA).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parts: Sequence[tuple[str, Placement]],
        shapes: Mapping[str, PairShape],
        dropout: float,
        bias: bool = False,
        dora: bool = False,
    ) -> None:
        """``parts``: each projection's short name and rows; ``shapes``: each one's rank and scale."""
        super().__init__()
        self.out_features = out_features
        self.placements = dict(parts)
        self.pairs = nn.ModuleDict(
            {name: LoraPair(in_features, _rows_of(p), shapes[name].r, bias, dora) for name, p in parts}
        )
        self.scalings = {name: shapes[name].scaling for name, _ in parts}
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.uses_dora = dora
        self.enabled = True  # off: the layer computes as the base model (a DPO reference, PEFT's disable_adapter)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def whole_rows(self) -> LocalRows:
        """Every row of the layer's output (no tensor parallel)."""
        return LocalRows(self.out_features, self.placements)

    def local_rows(self, output: DTensor, input_width: int) -> LocalRows:
        """This rank's rows of a tensor-parallel layer whose output is ``output``; ``input_width``:
        the number of input columns this rank holds (all, or a row-wise rank's equal share)."""
        placement, rank = output.placements[0], output.device_mesh.get_local_rank()
        if isinstance(placement, Partial):  # row-wise layer: all output rows, this rank's input columns
            columns = slice(rank * input_width, (rank + 1) * input_width)
            return LocalRows(self.out_features, self.placements, columns=columns, shares=output.device_mesh.size())
        if isinstance(placement, Shard):  # column-wise layer: this rank's output rows
            count = output.to_local().shape[-1]
            placements = {name: _first_chunk(p, count) for name, p in self.placements.items()}
            return LocalRows(count, placements, chunk=rank)
        raise ShardingError(f"LoRA on a layer whose output is {placement}: not a column- or row-wise layer")

    def delta(self, x: torch.Tensor, rows: LocalRows) -> torch.Tensor:
        """``(x @ A^T) @ (scaling · B)^T + scaling · bias`` over every pair at once, for ``rows``: the
        pairs' down-projections side by side (each of its own rank), times one ``B`` matrix that
        holds each pair's scaled rows at its projection's rows of the layer — two matrix products,
        no scatter of activations. Each of the ranks whose partial sums make the output adds its
        share of the bias (so every rank has the bias's gradient to sum)."""
        down = torch.cat([pair(x, columns=rows.columns) for pair in self.pairs.values()], dim=-1)
        result = down @ self.placed(rows, "lora_B").t()
        if next(iter(self.pairs.values())).lora_bias is not None:
            result = result + self.placed(rows, "lora_bias") / rows.shares
        return result

    def sharded(self, x: DTensor, output: DTensor) -> DTensor:
        """This rank's share of the adapters' output, in the layout of the layer's sharded ``output``."""
        rows = self.local_rows(output, x.to_local().shape[-1])
        # row-wise: this rank's input columns; column-wise: the whole input, whose gradient on each
        # rank is a partial sum
        local = x.to_local() if rows.chunk is None else x.to_local(grad_placements=[Partial()])
        return DTensor.from_local(self.delta(local, rows), output.device_mesh, output.placements, run_check=False)

    def placed(self, rows: LocalRows, parameter: str, scaled: bool = True) -> torch.Tensor:
        """A per-row parameter of the pairs (``lora_B``, ``lora_bias``, ``lora_magnitude``), each
        scaled unless not ``scaled``, at the pairs' rows of the layer (zero elsewhere); ``lora_B``'s
        blocks side by side, one per pair."""
        blocks: list[torch.Tensor] = []
        for name, pair in self.pairs.items():
            values: torch.Tensor = pair.get_parameter(parameter)
            values = values * self.scalings[name] if scaled else values
            values = values[rows.pair_rows(name, values.shape[0])]
            blocks.append(_place(values, rows.placements[name], rows.count))
        if parameter == "lora_B":
            return torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
        return torch.stack(blocks).sum(dim=0)

    def covered(self, rows: LocalRows) -> torch.Tensor:
        """Which of ``rows`` some pair adapts (a fused layer's other projections are left alone)."""
        mask = torch.zeros(rows.count, dtype=torch.bool)
        for placement in rows.placements.values():
            for _, layer_rows in placement:
                mask[layer_rows] = True
        return mask.to(self.lora_device)

    @property
    def lora_device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output for the whole layer (``x`` already dropped out)."""
        return self.delta(x, self.whole_rows())


def adapters_name(layer: str) -> str:
    """Where a layer's adapters live: ``….qkv_proj`` → ``….lora_qkv_proj`` (a sibling)."""
    parent, _, leaf = layer.rpartition(".")
    return f"{parent}.lora_{leaf}" if parent else f"lora_{leaf}"


def adapted_layer(adapters: str) -> str:
    """The layer adapters named ``adapters`` adapt (the inverse of :func:`adapters_name`)."""
    parent, _, leaf = adapters.rpartition(".")
    return f"{parent}.{leaf.removeprefix('lora_')}" if parent else leaf.removeprefix("lora_")


def row_index(placement: Placement) -> torch.Tensor:
    """The layer's rows of one projection, in the projection's own row order (on the CPU: an
    index, also when the layer is built on meta)."""
    index = torch.empty(_rows_of(placement), dtype=torch.int64, device="cpu")
    for pair_rows, layer_rows in placement:
        index[pair_rows] = torch.arange(layer_rows.start, layer_rows.stop, layer_rows.step or 1, device="cpu")
    return index


def _place(values: torch.Tensor, placement: Placement, rows: int) -> torch.Tensor:
    """``values`` (a pair's rows, first dim) at the layer's rows ``placement`` names, zero elsewhere."""
    if placement == ((slice(0, rows), slice(0, rows)),):
        return values  # the projection is the whole layer
    placed = values.new_zeros(rows, *values.shape[1:])
    for pair_rows, layer_rows in placement:
        placed[layer_rows] = values[pair_rows]
    return placed


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
