"""Text windows and the one data-parallel loader over them: dense windows, a fresh order per epoch,
disjoint shares per rank, every row once per epoch, the same global batches on any number of ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

from nemo_wrap.data import DataParallelBatches, read_token_windows, window_rows
from nemo_wrap.data.labels import IGNORE_INDEX
from nemo_wrap.errors import TrainingDataError


def _characters(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
    """A stand-in tokenizer: one token per character."""
    return {"input_ids": [ord(c) for c in text]}


def _numbered_rows(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` one-token windows numbered from 1 (a padding row's ``input_ids`` are 0)."""
    return window_rows(torch.arange(1, count + 1).view(count, 1))


def _epochs(count: int, dp_size: int, micro_batch_size: int, accumulation: int = 1, epochs: int = 2):
    """``[epoch][step][rank]``: the window numbers each rank learns from (padding rows left out),
    after checking that every rank takes the same steps of full-size micro-batches."""
    rows = _numbered_rows(count)
    ranks = [DataParallelBatches(rows, micro_batch_size, 7, rank, dp_size, accumulation) for rank in range(dp_size)]
    per_epoch = ranks[0].steps_per_epoch
    assert all(batches.steps_per_epoch == per_epoch for batches in ranks)
    steps = [iter(batches) for batches in ranks]
    seen = []
    for _ in range(epochs):
        epoch = []
        for _ in range(per_epoch):
            shares = []
            for step in (next(rank) for rank in steps):
                assert [mb["input_ids"].shape for mb in step] == [torch.Size([micro_batch_size, 1])] * accumulation
                stacked = {key: torch.cat([mb[key] for mb in step]) for key in ("input_ids", "labels")}
                learned = stacked["labels"][:, 0] != IGNORE_INDEX
                assert (stacked["input_ids"][~learned] == 0).all()  # padding: nothing to learn, no window
                shares.append(stacked["input_ids"][learned, 0].tolist())
            epoch.append(shares)
        seen.append(epoch)
    return seen


def test_windows_drop_the_ragged_tail(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("abcdefghij", encoding="utf-8")
    windows = read_token_windows(path, _characters, seq_len=3)
    assert windows.tolist() == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]


def test_window_rows_learn_every_token_at_their_positions():
    rows = window_rows(torch.tensor([[5, 6, 7], [8, 9, 10]]))
    assert [row["input_ids"].tolist() for row in rows] == [[[5, 6, 7]], [[8, 9, 10]]]
    assert all(torch.equal(row["labels"], row["input_ids"]) for row in rows)
    assert all(row["position_ids"].tolist() == [[0, 1, 2]] for row in rows)


@pytest.mark.parametrize(
    "content",
    [None, b"ab", b"\xff\xfe", "directory"],
    ids=["missing", "shorter-than-a-window", "not-utf8", "directory"],
)
def test_unusable_files_raise_naming_the_file(tmp_path, content):
    path = tmp_path / "text.txt"
    if content == "directory":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(TrainingDataError, match=r"text\.txt"):
        read_token_windows(path, _characters, seq_len=4)


def test_ranks_get_disjoint_shares_of_each_global_batch_and_epochs_reshuffle():
    epochs = _epochs(12, dp_size=2, micro_batch_size=2)
    assert [len(epoch) for epoch in epochs] == [3, 3]  # 12 windows / (2 x 2) = 3 global batches per epoch
    for epoch in epochs:
        for first, second in epoch:
            assert len(first) == len(second) == 2 and not set(first) & set(second)
        assert sorted(window for step in epoch for share in step for window in share) == list(range(1, 13))
    assert epochs[0] != epochs[1]


@pytest.mark.parametrize(
    ("count", "dp_size", "micro_batch_size", "accumulation"),
    [(12, 2, 2, 1), (13, 2, 2, 1), (7, 4, 1, 1), (11, 3, 2, 2), (3, 2, 4, 1), (1, 4, 2, 1)],
)
def test_every_window_once_per_epoch_on_every_layout(count, dp_size, micro_batch_size, accumulation):
    """Also when the windows do not divide, or fill less than one global batch (some ranks pad)."""
    for epoch in _epochs(count, dp_size, micro_batch_size, accumulation):
        seen = [window for step in epoch for share in step for window in share]
        assert sorted(seen) == list(range(1, count + 1))


@pytest.mark.parametrize("count", [12, 13, 3])
def test_a_steps_windows_do_not_depend_on_how_many_ranks_share_the_global_batch(count):
    """What lets a one-rank run and a data-parallel run of the same global batch match step by step."""
    by_degree = {
        dp_size: [
            [sorted(itertools.chain.from_iterable(step)) for step in epoch]
            for epoch in _epochs(count, dp_size, 4 // dp_size)
        ]
        for dp_size in (1, 2, 4)
    }
    assert by_degree[1] == by_degree[2] == by_degree[4]


def test_no_rows_or_an_impossible_layout_is_refused_before_the_first_step():
    with pytest.raises(TrainingDataError, match="no rows"):
        DataParallelBatches([], micro_batch_size=4, seed=0)
    rows = _numbered_rows(4)
    with pytest.raises(TrainingDataError, match="micro_batch_size=0"):
        DataParallelBatches(rows, micro_batch_size=0, seed=0)  # e.g. a global batch of 4 over 8 ranks
    with pytest.raises(TrainingDataError, match="accumulation=0"):
        DataParallelBatches(rows, micro_batch_size=2, seed=0, accumulation=0)
    with pytest.raises(TrainingDataError, match=r"dp_rank=2 .* dp_size=2"):
        DataParallelBatches(rows, micro_batch_size=2, seed=0, dp_rank=2, dp_size=2)
