"""This rank's part of a batch under context parallel, and the attention mask it needs.

The sequence (right-padded to a multiple of ``2·C``) is cut into ``2·C`` chunks; rank ``i`` keeps
chunks ``i`` and ``2C−1−i`` (Megatron's and torchtitan's load balance for causal attention: every
rank gets one early and one late chunk, so the same share of the causal triangle). Labels are
shifted *before* the cut (each kept token carries the label of the token after it in the whole
sequence; a shift after the cut would lose one label per chunk boundary). Positions stay global,
so RoPE sees where each token really is. The mask a rank's queries need over every rank's keys is
built from global token indices and documents: causal by index, the same document (packed rows
restart ``position_ids`` per example), valid keys only, and a sliding window where the layer has one.

A split is made active for the forward (a context variable), so the attention function — called by
transformers' models through the attention interface, or by our fused classes — finds it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nemo_wrap.errors import UnsupportedModelError

IGNORE_INDEX = -100
_ACTIVE: contextvars.ContextVar[SequenceSplit | None] = contextvars.ContextVar("nemo_wrap_sequence_split", default=None)


def active_split() -> SequenceSplit | None:
    """The split of the forward running now, or None outside context parallel."""
    return _ACTIVE.get()


def _chunk_indices(length: int, rank: int, size: int) -> torch.Tensor:
    """The global token indices rank ``rank`` of ``size`` keeps: chunks ``rank`` and ``2·size−1−rank``."""
    chunk = length // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([first, second])


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, which packed example it belongs to: a new one wherever positions do not go on by 1."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return torch.cumsum(starts, dim=1)


@dataclass(frozen=True)
class SequenceSplit:
    """One micro-batch as this cp rank holds it, and what its attention needs of the others' parts.

    ``input_ids``/``position_ids``/``shift_labels``: this rank's tokens (``[rows, L/C]``);
    ``query_index``/``key_index``: global indices of this rank's tokens and of every rank's, in the
    order keys are gathered (rank by rank); ``documents``/``valid``: per global token (``[rows, L]``).
    """

    group: dist.ProcessGroup | None
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    query_index: torch.Tensor
    key_index: torch.Tensor
    documents: torch.Tensor
    valid: torch.Tensor
    _attention_calls: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)
    _masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, batch: Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> SequenceSplit:
        """This rank's part of ``batch`` (``input_ids``, optional ``labels``, ``attention_mask``,
        ``position_ids``), padded at the right to a multiple of ``2·C`` tokens that never count."""
        return cls.cut(batch, dist.get_rank(group), dist.get_world_size(group), group)

    @classmethod
    def cut(
        cls, batch: Mapping[str, torch.Tensor], rank: int, size: int, group: dist.ProcessGroup | None = None
    ) -> SequenceSplit:
        """Rank ``rank`` of ``size``'s part of ``batch`` (pure: ``group`` is only kept for the attention)."""
        ids = batch["input_ids"]
        rows, length = ids.shape
        labels = batch.get("labels", ids)
        positions = batch.get("position_ids")
        positions = torch.arange(length).expand(rows, length) if positions is None else positions.expand(rows, length)
        valid = batch.get("attention_mask")
        valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.bool()
        shift = torch.cat([labels[:, 1:], torch.full((rows, 1), IGNORE_INDEX, dtype=labels.dtype)], dim=1)
        pad = -length % (2 * size)
        if pad:
            ids = torch.cat([ids, torch.zeros((rows, pad), dtype=ids.dtype)], dim=1)
            shift = torch.cat([shift, torch.full((rows, pad), IGNORE_INDEX, dtype=shift.dtype)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1)], dim=1)
            valid = torch.cat([valid, torch.zeros((rows, pad), dtype=torch.bool)], dim=1)
        mine = _chunk_indices(length + pad, rank, size)
        everyone = torch.cat([_chunk_indices(length + pad, r, size) for r in range(size)])
        return cls(
            group, ids[:, mine], positions[:, mine], shift[:, mine], mine, everyone, _documents(positions), valid
        )

    def count_attention_call(self) -> None:
        self._attention_calls[0] += 1

    def require_attention_calls(self, model_name: str) -> None:
        """Raise :class:`UnsupportedModelError` if no attention layer went through the split: a
        family that computes attention itself would attend within this rank's part alone."""
        if self._attention_calls[0] == 0:
            raise UnsupportedModelError(
                f"{model_name}: its attention does not go through transformers' attention interface, so "
                "context parallel cannot reach it (each rank would attend only its own part); use cp_size=1"
            )

    @contextmanager
    def active(self) -> Iterator[None]:
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    @property
    def key_order(self) -> torch.Tensor:
        """Where each global index sits among the gathered keys: ``gathered[:, :, key_order]`` puts
        every rank's keys back in sequence order."""
        return torch.argsort(self.key_index)

    def is_plain(self, sliding_window: int | None) -> bool:
        """Whether plain causal attention is exact for every real token: one document per row, no
        window, and padding (if any) only at the right end — no real token comes after a pad, so none
        attends one; what a pad attends reaches no real token."""
        one_document = bool((self.documents == self.documents[:, :1]).all())
        right_padded = bool((self.valid[:, 1:] <= self.valid[:, :-1]).all())
        return one_document and right_padded and sliding_window is None

    def query_chunks(self) -> list[tuple[slice, int]]:
        """This rank's two chunks of queries (a slice of its tokens each) and, for each, how many
        keys in sequence order it can see at most (causal: up to its last token)."""
        half = self.query_index.numel() // 2
        return [(part, int(self.query_index[part][-1]) + 1) for part in (slice(0, half), slice(half, 2 * half))]

    def chunk_mask(self, chunk: int, sliding_window: int | None) -> torch.Tensor:
        """The mask of one query chunk over the keys it can see (sequence order), made once per
        micro-batch: every layer, and every recomputation under activation checkpointing, shares it."""
        cached = (chunk, sliding_window)
        if cached not in self._masks:
            part, visible = self.query_chunks()[chunk]
            self._masks[cached] = self._mask(self.query_index[part], torch.arange(visible), sliding_window)
        return self._masks[cached]

    def mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """``[rows, 1, L/C, L]`` booleans: may this rank's query attend the gathered key (in gathered order)."""
        return self._mask(self.query_index, self.key_index, sliding_window)

    def _mask(self, queries: torch.Tensor, keys: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
        """Causal by global index, the same document, a valid key, inside the window. A query always
        sees itself, so a padding query's row is never empty (its output reaches no real token)."""
        query, key = queries[:, None], keys[None, :]
        causal = key <= query
        if sliding_window is not None:
            causal = causal & (query - key < sliding_window)
        documents = self.documents
        same_document = documents[:, queries, None] == documents[:, None, keys]
        allowed = causal[None] & same_document & self.valid[:, None, keys]
        return (allowed | (key == query)[None])[:, None]
