"""The dry run's even routing: every expert the same number of (token, slot) pairs, no expert twice a token."""

from __future__ import annotations

import pytest
import torch

from nemo_wrap.memory.balanced_routing import balanced_assignment


@pytest.mark.parametrize(("tokens", "slots", "experts"), [(12, 2, 4), (64, 8, 128), (5, 2, 8)])
def test_the_assignment_loads_the_experts_evenly_and_a_token_s_slots_differ(tokens, slots, experts):
    like = torch.zeros(1, dtype=torch.int32)
    assignment = balanced_assignment(tokens, slots, experts, like)
    assert assignment.shape == (tokens, slots) and assignment.dtype == torch.int32
    counts = torch.bincount(assignment.reshape(-1).long(), minlength=experts)
    assert int(counts.max() - counts.min()) <= 1 and int(counts.sum()) == tokens * slots
    assert all(len(set(row.tolist())) == slots for row in assignment)
