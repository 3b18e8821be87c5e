"""Training rows from one text file: dense token windows, dealt by :class:`DataParallelBatches`.

Enough for fine-tuning on a corpus that fits in memory (the embedded default's, or a user's text
file), with no dependency beyond the tokenizer. Windows are non-overlapping ``seq_len``-token
slices of the whole tokenized file; the ragged tail is dropped so every row is dense and needs no
padding or attention mask. Shuffling and splitting over ranks is not done here: the rows go through
the same :class:`nemo_wrap.data.DataParallelBatches` as a data set's, so a text job seeds, deals and
resumes exactly as every other job does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nemo_wrap.errors import TrainingDataError


def read_token_windows(path: str | Path, tokenizer: Any, seq_len: int) -> torch.Tensor:
    """The text file at ``path`` tokenized and cut into a ``[windows, seq_len]`` int64 tensor.

    Raises :class:`TrainingDataError` naming the file when it cannot be read as UTF-8 text or holds
    less than one window, so a job fails before loading a model rather than with nothing to train on.
    """
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
    ``[1, seq_len]``), the form :class:`nemo_wrap.data.DataParallelBatches` deals to ranks: every
    token is learned, and the explicit positions let a padding row be built like any other row."""
    positions = torch.arange(windows.shape[1]).unsqueeze(0)
    return [{"input_ids": w.unsqueeze(0), "labels": w.unsqueeze(0), "position_ids": positions} for w in windows]
