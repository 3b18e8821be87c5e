"""An exact checksum of a tensor's bytes keyed by global position, cheap enough to run on every load.

A block of a tensor (a rank's shard, or a window of a checkpoint tensor) is seen as rows of bytes:
the row is the global index over all dims but the last, the byte column the global index along the
last dim times the element size plus the byte. Its checksum is

    Σ_rows  key(row) · Σ_columns  byte · weight(column)     mod 2**31 - 1

with ``weight`` a nonzero int8 and ``key`` an integer below the prime, both fixed functions of the
global index. Everything is exact integer arithmetic, so the result depends neither on summation
order nor on how the tensor is cut into shards or blocks: the checksums of disjoint blocks add up
(mod the prime) to the checksum of the whole. Any change of one byte changes it; so does a value
moved to another row (a different key) or another column (a different weight, with high
probability). The inner sums are one int8 × int8 → int32 matrix product (``torch._int_mm``) over the
bytes as they lie in memory: no widening copy of the data, about one pass at memory speed. The
previous checksum widened every element to int64 and made a dozen passes; verify took 40× the load.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

PRIME = 2**31 - 1
# |byte| ≤ 128 and |weight| ≤ 127, so a product summed over 65,536 columns stays within int32.
_COLUMNS_PER_PRODUCT = 2**16


# The global indices of a block along one dim: a tensor (a shard's, possibly strided) or a range.
Index = torch.Tensor | range


def checksum(values: torch.Tensor, dim_indices: Sequence[Index], global_shape: Sequence[int]) -> int:
    """The checksum of ``values``, a block whose position ``i`` along dim ``d`` is global index
    ``dim_indices[d][i]`` of a tensor of ``global_shape``; in ``[0, PRIME)``."""
    if values.numel() == 0:
        return 0
    values = values.detach().cpu()
    if values.dim() == 0:
        values, dim_indices, global_shape = values.reshape(1), (range(1),), (1,)
    if values.stride(-1) != 1:
        values = values.contiguous()
    size = values.element_size()
    data = values.view(torch.int8).reshape(-1, values.shape[-1] * size)
    weights = _weights_of(dim_indices[-1], size)
    products = [
        torch._int_mm(data[:, start : start + _COLUMNS_PER_PRODUCT], weights[start : start + _COLUMNS_PER_PRODUCT])
        for start in range(0, data.shape[1], _COLUMNS_PER_PRODUCT)
    ]
    # One product's int32 sums times keys below 2**31 stay within int64; several are reduced first.
    row_sums = products[0].long()
    if len(products) > 1:
        row_sums = torch.stack([p.long() for p in products]).sum(dim=0).remainder_(PRIME)
    keys = _row_keys(dim_indices[:-1], global_shape[:-1])
    return int((row_sums.reshape(-1) * keys).remainder_(PRIME).sum()) % PRIME


def _global_rows(leading_indices: Sequence[Index], leading_shape: Sequence[int]) -> torch.Tensor:
    """The global row number of every local row (row-major over the leading dims)."""
    rows = torch.zeros((), dtype=torch.int64)
    for dim, index in enumerate(leading_indices):
        stride = math.prod(leading_shape[dim + 1 :])
        rows = rows.unsqueeze(-1) + _as_tensor(index) * stride
    return rows.reshape(-1)


def _weights_of(last_indices: Index, element_size: int) -> torch.Tensor:
    """The weight column (bytes × 1) for elements at global indices ``last_indices`` of the last dim.
    A contiguous range — nearly every block — is looked up in a cache: the same rows recur per layer."""
    span = _contiguous(last_indices)
    if span is not None:
        return _range_weights(span[0] * element_size, span[1] * element_size)
    columns = _as_tensor(last_indices).reshape(-1, 1) * element_size + torch.arange(element_size)
    return _column_weights(columns.reshape(-1))


def _contiguous(index: Index) -> tuple[int, int] | None:
    """``(first, count)`` when ``index`` is a run of consecutive integers, else ``None``."""
    if isinstance(index, range):
        return (index.start, len(index)) if index.step == 1 or len(index) == 1 else None
    first, count = int(index[0]), index.numel()
    return (first, count) if int(index[-1]) - first + 1 == count else None


def _as_tensor(index: Index) -> torch.Tensor:
    return torch.arange(index.start, index.stop, index.step) if isinstance(index, range) else index.to(torch.int64)


@functools.lru_cache(maxsize=64)
def _range_weights(first_column: int, count: int) -> torch.Tensor:
    return _column_weights(torch.arange(first_column, first_column + count))


def _column_weights(columns: torch.Tensor) -> torch.Tensor:
    """A nonzero int8 in [-127, 127] per global byte column, scattered by a multiplicative hash."""
    spread = torch.remainder(columns * 40503 + 7919, 254)
    return torch.where(spread < 127, spread - 127, spread - 126).to(torch.int8).reshape(-1, 1)


def _row_keys(leading_indices: Sequence[Index], leading_shape: Sequence[int]) -> torch.Tensor:
    """The key of every local row; a contiguous range of rows of a 2-D tensor comes from a cache."""
    span = _contiguous(leading_indices[0]) if len(leading_indices) == 1 else None
    if span is not None:
        return _range_keys(*span)
    return _keys(_global_rows(leading_indices, leading_shape))


@functools.lru_cache(maxsize=64)
def _range_keys(first_row: int, count: int) -> torch.Tensor:
    return _keys(torch.arange(first_row, first_row + count))


def _keys(rows: torch.Tensor) -> torch.Tensor:
    """A key in [1, PRIME) per global row."""
    return torch.remainder(rows * 69069 + 12345, PRIME - 1) + 1
