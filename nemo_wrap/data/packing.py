"""Several examples per row: positions restart at each, and nothing is learned across them.

transformers (and our fused classes, which build masks with its builders) derive a block-diagonal
causal mask from ``position_ids`` that restart, so attention never crosses an example. The first
label of every example is ``-100``: after the one-position shift it would be predicted from the
previous example's last token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_wrap.data.labels import IGNORE_INDEX, LabelledExample
from nemo_wrap.errors import TrainingDataError


def pack_examples(
    examples: Sequence[LabelledExample], max_length: int, pad_token_id: int
) -> list[dict[str, torch.Tensor]]:
    """Rows of at most ``max_length`` tokens, examples in order, each row padded to ``max_length``
    (the padding is an example of its own that learns nothing). Each row is a batch of one:
    ``input_ids``, ``labels`` and ``position_ids`` of shape ``[1, max_length]``."""
    rows: list[list[LabelledExample]] = [[]]
    for example in examples:
        if len(example) > max_length:
            raise TrainingDataError(f"an example of {len(example)} tokens does not fit a row of {max_length}")
        if sum(map(len, rows[-1])) + len(example) > max_length:
            rows.append([])
        rows[-1].append(example)
    return [_row(row, max_length, pad_token_id) for row in rows if row]


def _row(examples: list[LabelledExample], max_length: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    padding = max_length - sum(map(len, examples))
    parts = [*examples, LabelledExample((pad_token_id,) * padding, (IGNORE_INDEX,) * padding)] if padding else examples
    for example in parts:
        ids += example.input_ids
        labels += [IGNORE_INDEX, *example.labels[1:]]
        positions += range(len(example))
    return {
        "input_ids": torch.tensor([ids]),
        "labels": torch.tensor([labels]),
        "position_ids": torch.tensor([positions]),
    }
