"""Every case of the hostile corpus raises its specific error, naming the file, key or argument at
fault, within a few seconds and a few hundred MB — measured in one subprocess, case by case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import write_checkpoint
from tests.support.hostile_corpus import CASES

SECONDS_PER_CASE = 5.0
PEAK_MB_PER_CASE = 400.0  # above the process's memory when the case starts
CORPUS_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("corpus")
    good = write_checkpoint(root / "good", "llama", "half", tie=False)
    (root / "work").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.hostile_corpus", str(good), str(root / "work")],
        capture_output=True, text=True, timeout=CORPUS_TIMEOUT_S, cwd=Path(__file__).parents[2],
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0, result.stderr[-3000:]
    return {outcome["id"]: outcome for outcome in lines}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_hostile_checkpoint_raises_a_specific_error_in_bounded_time_and_memory(outcomes, case):
    outcome = outcomes[case.id]
    assert outcome["expected"], f"expected {case.error.__name__}, got {outcome['error']}: {outcome['message'][:500]}"
    assert outcome["nemo"]
    assert case.names in outcome["message"], outcome["message"][:500]
    assert len(outcome["message"]) < 2000
    assert outcome["seconds"] < SECONDS_PER_CASE
    assert outcome["peak_mb"] < PEAK_MB_PER_CASE
