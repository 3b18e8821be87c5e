"""The dry run's large allocations are fake: the factories that make them, and what it buys."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from nemo_wrap.memory.fake_allocations import LARGE_ELEMENTS, LargeAllocationsFake

LARGE, SMALL = (LARGE_ELEMENTS // 4, 4), (LARGE_ELEMENTS // 4 - 1, 4)


@pytest.mark.parametrize(
    "make",
    [
        lambda shape: torch.empty(shape),
        lambda shape: torch.zeros(shape, dtype=torch.bfloat16),
        lambda shape: torch.ones(shape),
        lambda shape: torch.full(shape, 7.0),
        lambda shape: torch.empty_strided(shape, (shape[1], 1)),
        lambda shape: torch.zeros(1).new_empty(shape),
        lambda shape: torch.zeros(1).new_zeros(shape),
    ],
    ids=["empty", "zeros", "ones", "full", "empty_strided", "new_empty", "new_zeros"],
)
def test_a_factory_of_a_large_tensor_gives_a_fake_one_a_small_one_stays_real(make):
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with LargeAllocationsFake(fake_mode):
        large, small = make(LARGE), make(SMALL)
    assert isinstance(large, FakeTensor) and large.fake_mode is fake_mode and large.shape == LARGE
    assert not isinstance(small, FakeTensor) and small.shape == SMALL


def test_a_like_factory_follows_its_template_s_size_and_a_fake_template_stays_in_its_mode():
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    real_large, real_small = torch.ones(LARGE), torch.ones(SMALL)
    with fake_mode:
        fake_small = torch.empty(SMALL)
    with LargeAllocationsFake(fake_mode):
        made = [torch.zeros_like(real_large), torch.empty_like(real_small), torch.ones_like(fake_small)]
    assert [isinstance(tensor, FakeTensor) for tensor in made] == [True, False, True]
    assert made[2].fake_mode is fake_mode
    # what is computed from real tensors stays real and right
    with LargeAllocationsFake(fake_mode):
        total = real_small.sum()
    assert not isinstance(total, FakeTensor) and total.item() == real_small.numel()
