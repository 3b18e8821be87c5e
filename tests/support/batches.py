"""The global batch many parity tests train on, and one data-parallel rank's micro-batches of it."""

from __future__ import annotations

import torch

GLOBAL_BATCH = 4
SEQUENCE = 16


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Right-padded sequences of different lengths: ranks get different label-token counts."""
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(4, 257, (GLOBAL_BATCH, SEQUENCE), generator=generator)
    lengths = torch.tensor([16, 5, 11, 16])
    mask = (torch.arange(SEQUENCE)[None, :] < lengths[:, None]).long()
    input_ids = input_ids.masked_fill(mask == 0, 3)  # pad token
    labels = input_ids.masked_fill(mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=mask, labels=labels)


def local_micro_batches(step: int, dp_rank: int, dp_size: int, micro: int) -> list[dict[str, torch.Tensor]]:
    """This dp rank's ``micro`` micro-batches of step ``step``'s global batch (two alternating batches)."""
    batch = global_batch(step % 2)  # two batches, alternating: the loss must fall
    per_rank = GLOBAL_BATCH // dp_size
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    local = {k: v[rows] for k, v in batch.items()}
    size = per_rank // micro
    return [{k: v[i * size:(i + 1) * size] for k, v in local.items()} for i in range(micro)]
