"""The text-file data loader: dense windows, a fresh order per epoch, disjoint shares per rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_wrap.errors import TrainingDataError
from nemo_wrap.training import iterate_batches, read_token_windows


def _characters(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
    """A stand-in tokenizer: one token per character."""
    return {"input_ids": [ord(c) for c in text]}


def test_windows_drop_the_ragged_tail(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("abcdefghij", encoding="utf-8")
    windows = read_token_windows(path, _characters, seq_len=3)
    assert windows.tolist() == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]


@pytest.mark.parametrize("content", [None, b"ab", b"\xff\xfe"], ids=["missing", "shorter-than-a-window", "not-utf8"])
def test_unusable_files_raise_naming_the_file(tmp_path, content):
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TrainingDataError, match="text.txt"):
        read_token_windows(path, _characters, seq_len=4)


def test_ranks_get_disjoint_shares_of_each_global_batch_and_epochs_reshuffle():
    windows = torch.arange(12).view(12, 1)
    ranks = [iterate_batches(windows, batch_size=2, seed=7, dp_rank=rank, dp_size=2) for rank in range(2)]
    steps = [[next(rank)["input_ids"].flatten().tolist() for rank in ranks] for _ in range(6)]
    for step in steps:
        assert not set(step[0]) & set(step[1])
    first_epoch = sorted(itertools.chain.from_iterable(itertools.chain.from_iterable(steps[:3])))
    assert first_epoch == list(range(12))  # 12 windows / (2 x 2) = 3 global batches per epoch
    assert steps[:3] != steps[3:]


def test_too_little_data_for_one_global_batch_raises():
    with pytest.raises(TrainingDataError, match="batch_size=4"):
        next(iterate_batches(torch.zeros(5, 3, dtype=torch.int64), batch_size=4, seed=0, dp_size=2))
