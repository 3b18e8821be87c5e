"""Leftovers of killed saves are resolved when the next run starts: staging removed, an ``.old-``
folder that is the only complete copy of its checkpoint moved back, nothing complete deleted.

Real checkpoints of a tiny model, one process; the crash states are made the way the code under
test would leave them (a rename aside, a staging copy, a half-finished deletion).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint import CheckpointRotation, load_checkpoint, newest_checkpoint
from nemo_wrap.checkpoint.leftovers import LeftoverAction, resolve_leftovers
from nemo_wrap.training import train_step
from tests.support.checkpoint_state import local_state
from tests.support.tiny_models import tiny_config

HEX = "0123456789ab"


def _model():
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), seed=3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_leftovers_are_removed_or_restored_and_no_complete_checkpoint_is_deleted(tmp_path: Path, one_thread) -> None:
    run = tmp_path / "run"
    model, optimizer = _model()
    rotation, states = CheckpointRotation(run, keep_last=None), {}
    for step in (1, 2, 3):
        train_step(model, optimizer, [{"input_ids": torch.randint(4, 257, (2, 12))}])
        rotation.save(model, optimizer, step)
        states[step] = local_state(model, optimizer)
    shutil.copytree(run / "checkpoint-3", run / f".checkpoint-4.tmp-{HEX}")  # a save killed before its move
    (run / "checkpoint-2").rename(run / f".checkpoint-2.old-{HEX}")  # a swap killed between its renames
    shutil.copytree(run / "checkpoint-3", run / f".checkpoint-3.old-{HEX}")  # replaced, not yet deleted
    (run / "checkpoint-1").rename(run / f".checkpoint-1.old-{HEX}")  # a deletion killed half-way...
    next((run / f".checkpoint-1.old-{HEX}").glob("*.distcp")).unlink()  # ...a shard already gone
    (run / f".latest.tmp-{HEX}").write_text("checkpoint-4\n")
    (tmp_path / f".run.tmp-{HEX}").mkdir()  # the final save's staging, beside the output directory
    (tmp_path / f".run.v2.tmp-{HEX}").mkdir()  # another run's (output directory run.v2): not ours
    (run / "notes").mkdir()
    (tmp_path / ".elsewhere").mkdir()

    done = {leftover.path.name: leftover for leftover in resolve_leftovers(run)}

    assert {name: leftover.action for name, leftover in done.items()} == {
        f".checkpoint-4.tmp-{HEX}": LeftoverAction.REMOVED,
        f".checkpoint-2.old-{HEX}": LeftoverAction.RESTORED,
        f".checkpoint-3.old-{HEX}": LeftoverAction.REMOVED,
        f".checkpoint-1.old-{HEX}": LeftoverAction.REMOVED,
        f".latest.tmp-{HEX}": LeftoverAction.REMOVED,
        f".run.tmp-{HEX}": LeftoverAction.REMOVED,
    }
    assert "the only complete copy of checkpoint-2" in done[f".checkpoint-2.old-{HEX}"].describe()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-2", "checkpoint-3", "latest", "notes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".elsewhere", f".run.v2.tmp-{HEX}", "run"]
    assert newest_checkpoint(run) == run / "checkpoint-3"
    for step in (2, 3):
        restored, restored_optimizer = _model()
        assert load_checkpoint(run / f"checkpoint-{step}", restored, restored_optimizer) == step
        state = local_state(restored, restored_optimizer)
        assert all(torch.equal(state[key], states[step][key]) for key in states[step])
    assert resolve_leftovers(run) == []  # nothing left to do
