"""The harness itself: real collectives, a failing rank's traceback, a hang that fails fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.support.multirank import RankCaseError


def case_all_reduce_sums_ranks() -> float:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def case_rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 waits for a rank that never comes


def case_rank0_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


def test_collective_runs_on_every_rank(ranks2):
    assert ranks2.run(case_all_reduce_sums_ranks) == [3.0, 3.0]


def test_failing_rank_traceback_is_reported_and_pool_recovers(ranks2):
    with pytest.raises(RankCaseError) as excinfo:
        ranks2.run(case_rank1_raises, timeout=60)
    report = str(excinfo.value)
    assert "rank 1 raised" in report and "deliberate failure on rank 1" in report
    assert "rank 0: no answer" in report
    assert ranks2.run(case_all_reduce_sums_ranks) == [3.0, 3.0]


def test_hang_fails_within_timeout(ranks2):
    started = time.monotonic()
    with pytest.raises(RankCaseError) as excinfo:
        ranks2.run(case_rank0_hangs, timeout=3)
    assert time.monotonic() - started < 20
    assert "rank 0: no answer" in str(excinfo.value)


def test_four_ranks(ranks4):
    assert ranks4.run(case_all_reduce_sums_ranks) == [10.0] * 4
