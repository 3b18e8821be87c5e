"""Row layouts of the fused projections, chosen so that tensor parallelism needs no re-packing.

Tensor parallelism shards a column-parallel ``nn.Linear`` with ``Shard(0)``: rank ``r`` of ``tp``
gets rows ``[r * rows / tp, (r + 1) * rows / tp)`` of the weight (and of the bias). A fused weight
is only usable that way if every such contiguous chunk is itself a complete, smaller fused weight.
The two layouts below have that property for *every* ``tp`` that divides the number of key/value
heads (attention) or ``intermediate_size`` (MLP), so one checkpoint layout serves all TP sizes, and
the forward recovers its local sizes from the width of its local output.

``qkv_proj`` — grouped by key/value head. For each kv head ``g`` in order::

    [ q heads g*r .. g*r+r-1   (r * head_dim rows)
      k head g                 (head_dim rows)
      v head g                 (head_dim rows) ]

with ``r = num_attention_heads // num_key_value_heads``. A chunk of ``num_kv / tp`` whole groups
holds exactly the query heads that attend to its kv heads (transformers' ``repeat_kv`` maps kv head
``g`` to query heads ``g*r .. g*r+r-1``), and its query heads are the contiguous slice of
``o_proj``'s input columns that ``Shard(1)`` gives the same rank.

``gate_up_proj`` — interleaved per row: ``[gate_0, up_0, gate_1, up_1, ...]``. A chunk of
``2 * intermediate_size / tp`` rows holds gate and up rows ``j`` for the same contiguous range of
``j``, which is also the range of ``down_proj``'s input columns on that rank. Interleaving per row
(rather than in blocks) makes this hold for every ``tp`` dividing ``intermediate_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig


@dataclass(frozen=True)
class RowSource:
    """Rows ``part_rows`` of unfused part ``part`` fill rows ``local_rows`` of a requested range.

    ``local_rows`` counts from the start of the requested range and may have a step (2 for the
    interleaved gate/up layout); ``part_rows`` is always contiguous.
    """

    part: int
    part_rows: slice
    local_rows: slice


def head_dim(config: PreTrainedConfig) -> int:
    """The per-head size: ``config.head_dim`` where the config has one (Qwen3, Llama), else derived."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class QKVLayout:
    """The kv-head-grouped layout of ``qkv_proj`` (see the module docstring)."""

    num_kv_heads: int
    heads_per_group: int
    head_dim: int

    @classmethod
    def from_config(cls, config: PreTrainedConfig) -> QKVLayout:
        return cls(
            num_kv_heads=config.num_key_value_heads,
            heads_per_group=config.num_attention_heads // config.num_key_value_heads,
            head_dim=head_dim(config),
        )

    @property
    def group_rows(self) -> int:
        """Rows of one kv-head group: its query heads, one key head and one value head."""
        return (self.heads_per_group + 2) * self.head_dim

    @property
    def rows(self) -> int:
        return self.num_kv_heads * self.group_rows

    def fuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Full q/k/v weights (or biases) → the fused tensor; rows move, columns do not."""
        rest = q.shape[1:]
        groups = (
            q.reshape(self.num_kv_heads, self.heads_per_group * self.head_dim, *rest),
            k.reshape(self.num_kv_heads, self.head_dim, *rest),
            v.reshape(self.num_kv_heads, self.head_dim, *rest),
        )
        return torch.cat(groups, dim=1).reshape(self.rows, *rest)

    def unfuse(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused tensor → contiguous full q, k, v tensors (inverse of :meth:`fuse`)."""
        rest = fused.shape[1:]
        grouped = fused.reshape(self.num_kv_heads, self.group_rows, *rest)
        q_rows = self.heads_per_group * self.head_dim
        q, k, v = grouped.split([q_rows, self.head_dim, self.head_dim], dim=1)
        return (
            q.reshape(self.num_kv_heads * q_rows, *rest).contiguous(),
            k.reshape(self.num_kv_heads * self.head_dim, *rest).contiguous(),
            v.reshape(self.num_kv_heads * self.head_dim, *rest).contiguous(),
        )

    def split_heads(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(batch, seq, local_rows)`` activations → q ``(b, s, heads, d)``, k and v ``(b, s, kv_heads, d)``.

        The number of groups is read from the width, so a rank holding a ``Shard(0)`` chunk of the
        weight computes on exactly its own heads.
        """
        batch, seq, width = projected.shape
        groups = width // self.group_rows
        grouped = projected.view(batch, seq, groups, self.heads_per_group + 2, self.head_dim)
        q, k, v = grouped.split([self.heads_per_group, 1, 1], dim=3)
        return q.reshape(batch, seq, groups * self.heads_per_group, self.head_dim), k.squeeze(3), v.squeeze(3)

    def sources(self, row_start: int, row_stop: int) -> list[RowSource]:
        """Which rows of q (part 0), k (part 1), v (part 2) fill fused rows ``[row_start, row_stop)``."""
        q_rows = self.heads_per_group * self.head_dim
        # (part, offset of the segment inside a group, segment length, rows of that part per group)
        segments = ((0, 0, q_rows), (1, q_rows, self.head_dim), (2, q_rows + self.head_dim, self.head_dim))
        found = []
        first_group = row_start // self.group_rows
        last_group = (row_stop - 1) // self.group_rows
        for group in range(first_group, last_group + 1):
            group_start = group * self.group_rows
            for part, offset, length in segments:
                start = max(row_start, group_start + offset)
                stop = min(row_stop, group_start + offset + length)
                if start >= stop:
                    continue
                part_start = group * length + (start - group_start - offset)
                found.append(
                    RowSource(
                        part=part,
                        part_rows=slice(part_start, part_start + stop - start),
                        local_rows=slice(start - row_start, stop - row_start),
                    )
                )
        return found


@dataclass(frozen=True)
class GateUpLayout:
    """The row-interleaved layout of ``gate_up_proj`` (see the module docstring)."""

    intermediate_size: int

    @classmethod
    def from_config(cls, config: PreTrainedConfig) -> GateUpLayout:
        return cls(intermediate_size=config.intermediate_size)

    @property
    def rows(self) -> int:
        return 2 * self.intermediate_size

    def fuse(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Full gate/up weights (or biases) → the interleaved fused tensor."""
        return torch.stack((gate, up), dim=1).reshape(self.rows, *gate.shape[1:])

    def unfuse(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused tensor → contiguous full gate and up tensors (inverse of :meth:`fuse`)."""
        gate, up = fused.reshape(self.intermediate_size, 2, *fused.shape[1:]).unbind(1)
        return gate.contiguous(), up.contiguous()

    @staticmethod
    def split_activations(projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(..., 2 * local_intermediate)`` → gate and up ``(..., local_intermediate)``, any local width."""
        gate, up = projected.unflatten(-1, (-1, 2)).unbind(-1)
        return gate, up

    def sources(self, row_start: int, row_stop: int) -> list[RowSource]:
        """Which rows of gate (part 0) and up (part 1) fill fused rows ``[row_start, row_stop)``.

        Part ``p`` sits on the fused rows of parity ``p``; each part contributes one contiguous run
        of its own rows, landing on every second row of the requested range.
        """
        found = []
        for part in (0, 1):
            first = row_start + (row_start + part) % 2  # first fused row of this parity
            count = len(range(first, row_stop, 2))
            if count:
                found.append(
                    RowSource(
                        part=part,
                        part_rows=slice(first // 2, first // 2 + count),
                        local_rows=slice(first - row_start, row_stop - row_start, 2),
                    )
                )
        return found
