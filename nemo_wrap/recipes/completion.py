"""The record that a run finished: its final model saved after its last step.

A run's checkpoints say how far it got; they cannot say that it finished, because the final save
comes after the last one. Without a record of that, a rerun with ``--resume auto`` after a job that
completed (say, one that a SIGTERM reached during its final save, which it completed) would resume
from the newest checkpoint and train its last steps again. So after the final save, rank 0 writes
:data:`COMPLETION_FILE` (atomically) naming the number of steps, and a rerun of the same job with
``--resume auto`` finds it and trains nothing. A run that is about to train removes it first: a
record left by an earlier job must not make a later, interrupted one look finished.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from nemo_wrap.checkpoint.atomic import write_text_atomically
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointSaveError

COMPLETION_FILE = "training_complete.json"  # in the output directory: {"steps": N}


def _read_steps(output_dir: Path) -> int | None:
    try:
        record = json.loads((output_dir / COMPLETION_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    steps = record.get("steps") if isinstance(record, dict) else None
    return steps if type(steps) is int else None


def completed_steps(output_dir: str | Path) -> int | None:
    """How many steps the finished run in ``output_dir`` trained (``None``: no finished run there).
    Rank 0 reads the record and every rank gets its answer."""
    return RankGroup.job().on_rank_zero(
        "reading the completion record", partial(_read_steps, Path(output_dir)), partial(_failed, output_dir)
    )


def record_completion(output_dir: str | Path, steps: int) -> None:
    """Record that the run in ``output_dir`` finished after ``steps`` steps (rank 0 writes it)."""
    write = partial(write_text_atomically, Path(output_dir) / COMPLETION_FILE, json.dumps({"steps": steps}) + "\n")
    RankGroup.job().on_rank_zero("writing the completion record", write, partial(_failed, output_dir))


def clear_completion(output_dir: str | Path) -> None:
    """Forget an earlier run's record before this one trains (rank 0 removes it)."""
    remove = partial((Path(output_dir) / COMPLETION_FILE).unlink, missing_ok=True)
    RankGroup.job().on_rank_zero("removing the completion record", remove, partial(_failed, output_dir))


def _failed(output_dir: str | Path, description: str) -> CheckpointSaveError:
    return CheckpointSaveError(f"{Path(output_dir) / COMPLETION_FILE}: {description}")
