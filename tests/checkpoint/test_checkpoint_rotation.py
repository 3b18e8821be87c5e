"""CheckpointRotation: ``checkpoint-{step}`` folders, the ``latest`` pointer, pruning, background saves.

Multi-rank cases run a tiny fused Llama under fsdp2 on two real gloo ranks, so every checkpoint is
sharded and every background write runs DCP's collectives on the rotation's own process group while
the training's run on the default one. Saved state is compared bit for bit after loading it into a
model built from another seed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from nemo_wrap import DistributedSetup
from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint import CheckpointRotation, load_checkpoint, newest_checkpoint, resolve_resume
from nemo_wrap.checkpoint import rotation as rotation_module
from nemo_wrap.errors import CheckpointNotFoundError, CheckpointSaveError, InvalidSetupError
from nemo_wrap.training import train_step
from tests.support.checkpoint_state import kill_at_markers, local_state
from tests.support.tiny_models import tiny_config

SEED = 1234
REPO = Path(__file__).resolve().parents[2]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _build(seed: int = SEED):
    setup = None
    if torch.distributed.is_initialized():
        setup = DistributedSetup.build("fsdp2", torch.distributed.get_world_size())
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), distributed_setup=setup, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, step: int) -> float:
    generator = torch.Generator().manual_seed(1000 * step + _rank())
    batch = {"input_ids": torch.randint(4, 257, (2, 12), generator=generator)}
    return train_step(model, optimizer, [batch], max_grad_norm=1.0).loss


def _loaded(directory: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model, optimizer = _build(seed=SEED + 1)
    step = load_checkpoint(directory, model, optimizer)
    return step, local_state(model, optimizer)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _fake_checkpoint(directory: Path) -> Path:
    """A folder that looks complete to the file checks (they look for DCP's .metadata only)."""
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(b"")
    return directory


# -- several ranks ----------------------------------------------------------------------------------
def case_keep_last_two(directory: str) -> dict:
    model, optimizer = _build()
    rotation = CheckpointRotation(directory, keep_last=2)
    saved = {}
    for step in range(1, 6):
        _train(model, optimizer, step)
        assert rotation.save(model, optimizer, step) == Path(directory) / f"checkpoint-{step}"
        saved[step] = local_state(model, optimizer)
    restored = {step: _loaded(Path(directory) / f"checkpoint-{step}") for step in (4, 5)}
    return {step: (loaded_step, _same(state, saved[step])) for step, (loaded_step, state) in restored.items()}


def test_keep_last_two_after_five_saves(ranks2, tmp_path):
    directory = tmp_path / "run"
    for rank, restored in enumerate(ranks2.run(case_keep_last_two, str(directory))):
        assert restored == {4: (4, True), 5: (5, True)}, rank
    assert _listing(directory) == ["checkpoint-4", "checkpoint-5", "latest"]
    assert (directory / "latest").read_text() == "checkpoint-5\n"
    assert newest_checkpoint(directory) == directory / "checkpoint-5"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def case_background_save_matches_sync(directory: str) -> dict:
    """Save step 2 both ways, train on while the background write runs, then resume from it."""
    model, optimizer = _build()
    sync = CheckpointRotation(Path(directory) / "sync", keep_last=None)
    background = CheckpointRotation(Path(directory) / "async", keep_last=None, asynchronous=True)
    for step in (1, 2):
        _train(model, optimizer, step)
    sync.save(model, optimizer, 2)
    background.save(model, optimizer, 2)
    saved = local_state(model, optimizer)
    expected = [_train(model, optimizer, step) for step in (3, 4)]  # while it writes: it saved a copy
    written = background.wait()
    background.close()
    sync_step, sync_state = _loaded(Path(directory) / "sync" / "checkpoint-2")
    model, optimizer = _build(seed=SEED + 1)
    async_step = load_checkpoint(written, model, optimizer)
    async_same = _same(local_state(model, optimizer), saved)
    losses = [_train(model, optimizer, step) for step in (3, 4)]
    return {"steps": (sync_step, async_step), "same": (_same(sync_state, saved), async_same),
            "expected": expected, "losses": losses}  # fmt: skip


def test_background_save_matches_sync_and_resumes_the_same_run(ranks2, tmp_path):
    for rank, result in enumerate(ranks2.run(case_background_save_matches_sync, str(tmp_path))):
        assert result["steps"] == (2, 2) and result["same"] == (True, True), rank
        assert result["losses"] == result["expected"], rank
    sync, background = tmp_path / "sync" / "checkpoint-2", tmp_path / "async" / "checkpoint-2"
    shards = [".metadata", "__0_0.distcp", "__1_0.distcp", "nemo_wrap_manifest.json"]
    assert _listing(sync) == _listing(background) == shards
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (sync / name).read_bytes() == (background / name).read_bytes(), name
    assert (tmp_path / "async" / "latest").read_text() == "checkpoint-2\n"


def case_background_write_fails_on_one_rank(directory: str) -> dict:
    """Rank 1's disk fills up during the background write of step 3."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model, optimizer = _build()
    rotation = CheckpointRotation(directory, keep_last=2, asynchronous=True)
    for step in (1, 2):
        _train(model, optimizer, step)
        rotation.save(model, optimizer, step)
    rotation.wait()  # step 2 is in place before rank 1's disk fills up
    write_data = FileSystemWriter.write_data

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device", str(self.path))

    if _rank() == 1:
        FileSystemWriter.write_data = disk_full
    try:
        rotation.save(model, optimizer, 3)
        _train(model, optimizer, 3)
        with pytest.raises(CheckpointSaveError) as failed:
            rotation.save(model, optimizer, 4)  # step 3's failure surfaces here, on every rank
    finally:
        FileSystemWriter.write_data = write_data
    after_failure = newest_checkpoint(directory)
    rotation.save(model, optimizer, 4)
    rotation.close()
    return {"message": str(failed.value), "after_failure": after_failure, "restored": _loaded(after_failure)[0]}


def test_a_failed_background_write_raises_on_every_rank_and_keeps_the_previous_checkpoint(ranks2, tmp_path):
    directory = tmp_path / "run"
    for rank, result in enumerate(ranks2.run(case_background_write_fails_on_one_rank, str(directory))):
        assert str(directory / "checkpoint-3") in result["message"] and "step 3" in result["message"], rank
        assert "No space left on device" in result["message"], rank
        assert result["after_failure"] == directory / "checkpoint-2" and result["restored"] == 2, rank
    assert _listing(directory) == ["checkpoint-2", "checkpoint-4", "latest"]  # step 3's staging is gone
    assert (directory / "latest").read_text() == "checkpoint-4\n"


def case_background_copy_fails_on_one_rank(directory: str) -> dict:
    """Rank 1 runs out of memory copying the state of step 2: no rank starts its writer thread."""
    import time

    from torch.distributed.checkpoint.staging import DefaultStager

    model, optimizer = _build()
    rotation = CheckpointRotation(directory, keep_last=2, asynchronous=True)
    _train(model, optimizer, 1)
    rotation.save(model, optimizer, 1)
    stage = DefaultStager.stage

    def out_of_memory(self, state_dict, **kwargs):
        raise MemoryError("cannot allocate the copy")

    if _rank() == 1:
        DefaultStager.stage = out_of_memory
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointSaveError) as failed:
            rotation.save(model, optimizer, 2)
    finally:
        DefaultStager.stage = stage
    took = time.monotonic() - started
    rotation.save(model, optimizer, 3)  # the background group is free: no writer thread is stuck in it
    rotation.close()
    return {"message": str(failed.value), "took": took, "restored": _loaded(Path(directory) / "checkpoint-3")[0]}


def test_a_failed_background_copy_raises_on_every_rank_at_once_and_the_next_save_works(ranks2, tmp_path):
    directory = tmp_path / "run"
    for rank, result in enumerate(ranks2.run(case_background_copy_fails_on_one_rank, str(directory))):
        assert result["message"].startswith(f"{directory / 'checkpoint-2'}: starting the background write failed: ")
        said = "cannot allocate the copy" if rank == 1 else "another rank failed while copying the state to write"
        assert said in result["message"], rank
        assert result["took"] < 10 and result["restored"] == 3, rank  # the group's timeout is 600 s
    assert _listing(directory) == ["checkpoint-1", "checkpoint-3", "latest"]


def case_resolve_resume(output_dir: str, empty: str, bogus: str) -> dict:
    newest = rotation_module.newest_checkpoint
    if _rank() == 1:  # rank 1 would see another newest checkpoint: rank 0's answer must win anyway
        rotation_module.newest_checkpoint = lambda _: Path("/rank1/checkpoint-9")
    try:
        with pytest.raises(CheckpointNotFoundError) as not_found:
            resolve_resume(bogus, output_dir)
        return {
            "none": resolve_resume(None, output_dir),
            "auto": resolve_resume("auto", output_dir),
            "empty": resolve_resume("auto", empty),
            "missing": resolve_resume("auto", Path(empty) / "never-made"),
            "explicit": resolve_resume(str(Path(output_dir) / "checkpoint-2"), empty),
            "bogus": str(not_found.value),
        }
    finally:
        rotation_module.newest_checkpoint = newest


def test_resolve_resume_gives_every_rank_rank_zeros_answer(ranks2, tmp_path):
    run, empty, bogus = tmp_path / "run", tmp_path / "empty", tmp_path / "no-such-checkpoint"
    for step in (2, 10):
        _fake_checkpoint(run / f"checkpoint-{step}")
    empty.mkdir()
    for rank, result in enumerate(ranks2.run(case_resolve_resume, str(run), str(empty), str(bogus))):
        assert result["none"] is None and result["empty"] is None and result["missing"] is None, rank
        assert result["auto"] == run / "checkpoint-10", rank
        assert result["explicit"] == run / "checkpoint-2", rank
        assert str(bogus) in result["bogus"], rank


# -- one process ------------------------------------------------------------------------------------
def test_pruning_never_touches_other_folders_and_files(tmp_path, one_thread):
    run, elsewhere = tmp_path / "run", _fake_checkpoint(tmp_path / "elsewhere")
    unrelated = {
        "notes": lambda p: (p.mkdir(), (p / "todo.txt").write_text("keep")),
        "checkpoint-best": _fake_checkpoint,  # complete, but not a numbered checkpoint
        "checkpoint-1": lambda p: (p.mkdir(), (p / "model.safetensors").write_bytes(b"x")),  # no .metadata
        "checkpoint-2": lambda p: p.write_text("a file"),
        ".checkpoint-3.tmp-0123456789ab": _fake_checkpoint,  # a killed save's staging directory
        "checkpoint-0": lambda p: p.symlink_to(elsewhere),
    }
    run.mkdir()
    for name, make in unrelated.items():
        make(run / name)
    model, optimizer = _build()
    rotation = CheckpointRotation(run, keep_last=1)
    for step in (4, 5, 6):
        _train(model, optimizer, step)
        rotation.save(model, optimizer, step)
    assert _listing(run) == sorted([*unrelated, "checkpoint-6", "latest"])
    assert (run / "notes" / "todo.txt").read_text() == "keep" and (elsewhere / ".metadata").is_file()
    assert _listing(run / "checkpoint-1") == ["model.safetensors"]
    assert newest_checkpoint(run) == run / "checkpoint-6"
    step, state = _loaded(run / "checkpoint-6")
    assert step == 6 and _same(state, local_state(model, optimizer))


def test_newest_checkpoint_falls_back_to_the_highest_complete_step(tmp_path):
    assert newest_checkpoint(tmp_path / "missing") is None
    assert newest_checkpoint(tmp_path) is None
    for step in (3, 20):
        _fake_checkpoint(tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-100").mkdir()  # a save that never finished: no .metadata
    _fake_checkpoint(tmp_path / ".checkpoint-200.tmp-0123456789ab")
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint-20"
    (tmp_path / "latest").write_text("checkpoint-3\n")
    assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"  # the pointer wins
    for stale in ("checkpoint-7", "checkpoint-100", "../elsewhere", "", "\xff"):
        (tmp_path / "latest").write_text(stale, encoding="latin-1")
        assert newest_checkpoint(tmp_path) == tmp_path / "checkpoint-20", stale


def test_a_background_save_writes_the_state_of_its_call_while_training_goes_on(tmp_path, one_thread, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data, trained, seen = FileSystemWriter.write_data, threading.Event(), []

    def write_after_the_next_step(writer, plan, planner):
        seen.append(trained.wait(timeout=60))
        return write_data(writer, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_after_the_next_step)
    model, optimizer = _build()
    _train(model, optimizer, 1)
    rotation = CheckpointRotation(tmp_path, keep_last=None, asynchronous=True)
    rotation.save(model, optimizer, 1)
    saved = local_state(model, optimizer)
    _train(model, optimizer, 2)  # the writer is still waiting: save() returned before writing
    assert not (tmp_path / "checkpoint-1").exists() and not (tmp_path / "latest").exists()
    trained.set()
    assert rotation.wait() == tmp_path / "checkpoint-1" and seen == [True]
    assert rotation.wait() is None
    step, state = _loaded(tmp_path / "checkpoint-1")
    assert step == 1 and _same(state, saved) and not _same(state, local_state(model, optimizer))
    assert (tmp_path / "latest").read_text() == "checkpoint-1\n"


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5])
def test_keep_last_must_be_a_positive_integer(keep_last, tmp_path):
    with pytest.raises(InvalidSetupError, match="keep_last"):
        CheckpointRotation(tmp_path, keep_last=keep_last)


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.checkpoint import CheckpointRotation
    from tests.support.tiny_models import tiny_config

    write_data = FileSystemWriter.write_data

    def write_then_stall(writer, plan, planner):  # the shards are written, .metadata is not
        written = write_data(writer, plan, planner)
        written.wait()
        if ".checkpoint-2.tmp-" in str(writer.path):
            Path({marker!r}).touch()
            time.sleep(600)
        return written

    FileSystemWriter.write_data = write_then_stall
    model = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), seed=99)
    optimizer = torch.optim.AdamW(model.parameters())
    rotation = CheckpointRotation({target!r}, keep_last=1, asynchronous={asynchronous})
    rotation.save(model, optimizer, 1)
    rotation.save(model, optimizer, 2)  # in the background: puts checkpoint-1 in place first
    rotation.wait()
    """
)


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_newest(tmp_path, one_thread):
    children = []
    for asynchronous in (False, True):  # both at once: the interpreter start-up dominates
        target, marker = tmp_path / f"async-{asynchronous}", tmp_path / f"async-{asynchronous}.marker"
        code = _KILLED_SAVE.format(repo=str(REPO), marker=str(marker), target=str(target), asynchronous=asynchronous)
        children.append((subprocess.Popen([sys.executable, "-c", code]), marker))
    kill_at_markers(children)
    expected = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), seed=99).state_dict()
    for asynchronous in (False, True):
        target = tmp_path / f"async-{asynchronous}"
        (staged,) = [p for p in target.iterdir() if p.name.startswith(".checkpoint-2.tmp-")]
        assert ".metadata" not in _listing(staged) and _listing(staged), asynchronous
        assert _listing(target) == sorted(["checkpoint-1", "latest", staged.name]), asynchronous
        assert newest_checkpoint(target) == target / "checkpoint-1", asynchronous
        assert resolve_resume("auto", target) == target / "checkpoint-1", asynchronous
        model = NeMoAutoModelForCausalLM.from_config(tiny_config("own-llama"), seed=SEED + 1)
        assert load_checkpoint(target / "checkpoint-1", model, torch.optim.AdamW(model.parameters())) == 1
        assert _same(model.state_dict(), expected), asynchronous
