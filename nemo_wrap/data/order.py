"""Which examples a data-parallel rank sees in an epoch: a seeded shuffle, dealt out in turn.

The same on every run for the same (seed, epoch), so a resumed run that knows its epoch and its
position in it sees exactly the examples the uninterrupted run would have.
"""

from __future__ import annotations

import torch


def epoch_order(num_examples: int, seed: int, epoch: int, dp_rank: int, dp_size: int) -> list[int]:
    """This rank's example indices for ``epoch``: every index goes to exactly one rank per epoch.

    When ``num_examples`` does not divide, the first ranks hold one more; callers give the others an
    empty (all ``-100``) micro-batch for that step, so every rank takes the same number of steps.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    permutation = torch.randperm(num_examples, generator=generator).tolist()
    return permutation[dp_rank::dp_size]
