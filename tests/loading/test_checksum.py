"""The load-verification checksum: exact, additive over any cut into blocks, sensitive to one bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_wrap.loading.checksum import PRIME, checksum

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool]


def _random(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(0, 200, shape, generator=generator).to(dtype)


def _whole(values):
    return checksum(values, [torch.arange(n) for n in values.shape], tuple(values.shape))


def _reference(values):
    """The definition, in Python integers: Σ_rows key(row) · Σ_byte-columns byte · weight(column)."""
    values = values.reshape(1) if values.dim() == 0 else values
    size = values.element_size()
    data = values.contiguous().view(torch.int8).reshape(-1, values.shape[-1] * size).tolist()
    total = 0
    for row, row_bytes in enumerate(data):
        spread = [(column * 40503 + 7919) % 254 for column in range(len(row_bytes))]
        weights = [s - 127 if s < 127 else s - 126 for s in spread]
        inner = sum(b * w for b, w in zip(row_bytes, weights, strict=True))
        total += (inner % PRIME) * ((row * 69069 + 12345) % (PRIME - 1) + 1)
    return total % PRIME


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (7,), (5, 6), (3, 4, 5)], ids=str)
def test_checksum_is_its_definition(shape, dtype):
    values = _random(shape, dtype)
    assert _whole(values) == _reference(values)


def test_rows_wider_than_one_product_are_exact():
    """A row of 160,000 bytes is summed over three int32 products: the int64 total stays exact."""
    values = _random((2, 40_000), torch.float32)
    assert _whole(values) == _reference(values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocks_of_any_cut_add_up_to_the_whole(dtype):
    """Shards, strided shards (interleaved rows) and windows: the pieces' checksums sum to the whole's."""
    values = _random((6, 10, 4), dtype, seed=1)
    generator = torch.Generator().manual_seed(2)
    for _ in range(20):
        pieces = [_partition(n, generator) for n in values.shape]
        total = 0
        for indices in itertools.product(*pieces):
            block = values[torch.meshgrid(*indices, indexing="ij")]
            total += checksum(block, indices, tuple(values.shape))
        assert total % PRIME == _whole(values)


def _partition(size, generator):
    """A random split of ``range(size)`` into increasing index lists, some of them strided."""
    owner = torch.randint(0, 3, (size,), generator=generator)
    return [torch.nonzero(owner == k).flatten() for k in range(3) if (owner == k).any()]


def test_a_strided_view_equals_its_contiguous_copy():
    values = _random((8, 6), torch.float32).t()
    assert values.stride(-1) != 1
    assert _whole(values) == _whole(values.contiguous())


def test_every_single_bit_flip_is_caught():
    values = _random((3, 5), torch.bfloat16)
    clean = _whole(values)
    bits = values.view(torch.int16).reshape(-1)
    for position, bit in itertools.product(range(bits.numel()), range(16)):
        damaged = bits.clone()
        damaged[position] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)
        assert _whole(damaged.view(torch.bfloat16).reshape(3, 5)) != clean, (position, bit)


def test_every_swap_of_two_unequal_values_is_caught():
    values = _random((4, 6), torch.float32)
    clean = _whole(values)
    flat = values.reshape(-1)
    for a, b in itertools.combinations(range(flat.numel()), 2):
        swapped = flat.clone()
        swapped[[a, b]] = flat[[b, a]]
        assert _whole(swapped.reshape(4, 6)) != clean, (a, b)


def test_ranges_and_index_tensors_name_the_same_positions():
    """The loader's windows come as ranges (stepped for interleaved rows), shards as index tensors."""
    values = _random((3, 4, 6), torch.bfloat16, seed=3)
    shape = (8, 4, 13)
    as_ranges = [range(1, 7, 2), range(4), range(5, 11)]
    as_tensors = [torch.arange(r.start, r.stop, r.step) for r in as_ranges]
    assert checksum(values, as_ranges, shape) == checksum(values, as_tensors, shape)
    assert checksum(values[0, 0], [range(5, 11)], (13,)) == checksum(values[0, 0], [torch.arange(5, 11)], (13,))
