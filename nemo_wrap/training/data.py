"""A small data loader over one text file: token windows, reshuffled every epoch, split over ranks.

Enough for fine-tuning on a corpus that fits in memory (the embedded default's, or a user's text
file), with no dependency beyond the tokenizer. Windows are non-overlapping ``seq_len``-token
slices of the whole tokenized file; the ragged tail is dropped so every batch is dense and needs
no padding or attention mask. Every data-parallel rank draws the same permutation (seeded by the
seed and the epoch) and takes its own slice of each global batch, so ranks never see the same
window in one step and a run is reproducible for a given seed and data-parallel degree.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nemo_wrap.errors import TrainingDataError


def read_token_windows(path: str | Path, tokenizer: Any, seq_len: int) -> torch.Tensor:
    """The text file at ``path`` tokenized and cut into a ``[windows, seq_len]`` int64 tensor."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TrainingDataError(f"training data {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise TrainingDataError(f"training data {str(path)!r} is a directory, not a text file") from None
    except UnicodeDecodeError as error:
        raise TrainingDataError(f"training data {str(path)!r} is not UTF-8 text (byte {error.start})") from None
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
    count = ids.numel() // seq_len
    if count == 0:
        raise TrainingDataError(
            f"training data {str(path)!r} has {ids.numel()} tokens, fewer than one window of seq_len={seq_len}"
        )
    return ids[: count * seq_len].view(count, seq_len)


def window_rows(windows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each window as a training row (``input_ids``, ``labels``, ``position_ids`` of shape
    ``[1, seq_len]``), the form :class:`nemo_wrap.data.DataParallelBatches` deals to ranks."""
    positions = torch.arange(windows.shape[1]).unsqueeze(0)
    return [{"input_ids": w.unsqueeze(0), "labels": w.unsqueeze(0), "position_ids": positions} for w in windows]


def iterate_batches(
    windows: torch.Tensor, batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless ``{"input_ids": [batch_size, seq_len]}`` batches: this data-parallel rank's share.

    Each epoch is one permutation of the windows cut into global batches of ``batch_size *
    dp_size`` (an incomplete last one is skipped); rank ``dp_rank`` gets rows ``dp_rank *
    batch_size`` onward of each. Raises :class:`TrainingDataError` when one global batch does not fit.
    """
    global_batch = batch_size * dp_size
    per_epoch = windows.shape[0] // global_batch
    if per_epoch == 0:
        raise TrainingDataError(
            f"the training data holds {windows.shape[0]} window(s) of {windows.shape[1]} tokens, fewer than one "
            f"global batch (batch_size={batch_size} x {dp_size} data-parallel rank(s)); use more text, a "
            "smaller --batch-size or a shorter --seq-len"
        )
    epoch = 0
    while True:
        order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, per_epoch * global_batch, global_batch):
            mine = order[start + dp_rank * batch_size : start + (dp_rank + 1) * batch_size]
            yield {"input_ids": windows[mine]}
        epoch += 1
