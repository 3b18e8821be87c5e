"""Checkpoints that manage themselves: ``checkpoint-{step}`` folders, a ``latest`` pointer, pruning.

A long run saves every few hundred steps; left alone the checkpoints fill the disk, and a resume
after a crash must find the newest checkpoint that was *completely* written, never one a killed
save left half-way. So :class:`CheckpointRotation` writes each ``checkpoint-{step}`` atomically
(:func:`save_checkpoint`: staged in a hidden sibling, then moved in whole), then names it in
``latest`` (a one-line file swapped in with ``os.replace``), and only then deletes the oldest
complete checkpoints beyond ``keep_last``. Wherever a crash strikes, ``latest`` names a complete
checkpoint or is missing, and :func:`newest_checkpoint` falls back to the folders.

With ``asynchronous=True`` the write runs in a background thread on a process group of its own
(:func:`start_checkpoint_save`); the move, the pointer and the pruning wait until that write is
done, at the next :meth:`CheckpointRotation.save` or at :meth:`CheckpointRotation.wait`, which
every rank calls at the same point of the run, so their collectives stay in step.

Which checkpoint a run resumes from is decided by rank 0 and broadcast (:func:`resolve_resume`):
ranks reading the shared filesystem at slightly different moments (rank 0 may be pruning, a
network filesystem may cache a listing) could otherwise pick different ones and load mixed state.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from nemo_wrap.checkpoint.atomic import STAGING_NAME, save_failed, write_text_atomically
from nemo_wrap.checkpoint.resume import (
    PendingSave,
    checkpoint_process_group,
    holds_checkpoint,
    save_checkpoint,
    start_checkpoint_save,
)
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointNotFoundError, InvalidSetupError

LATEST = "latest"  # the pointer file in the output directory: the newest checkpoint's folder name
AUTO = "auto"  # resume="auto": from the newest complete checkpoint, or from scratch if there is none
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def _incomplete(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or ``None`` when it is one."""
    if not path.is_dir():
        return "no such directory"
    if STAGING_NAME.fullmatch(path.name):
        return "a save's staging directory, not a finished checkpoint"
    if not holds_checkpoint(path):
        return "no resumable checkpoint in it (DCP's .metadata is missing)"
    return None


def is_complete_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint a save finished: DCP's ``.metadata`` is in (written once
    every rank's shards are) and it is not a staging directory."""
    return _incomplete(Path(path)) is None


def _numbered(output_dir: Path) -> list[tuple[int, Path]]:
    """The complete ``checkpoint-N`` folders of ``output_dir`` with their ``N``, oldest first."""
    if not output_dir.is_dir():
        return []
    found = []
    for entry in output_dir.iterdir():
        match = _CHECKPOINT.fullmatch(entry.name)
        if match and is_complete_checkpoint(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _pointed(output_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, if it is readable and names a complete one."""
    try:
        name = (output_dir / LATEST).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _CHECKPOINT.fullmatch(name):  # a folder of this directory, nothing else
        return None
    return output_dir / name if is_complete_checkpoint(output_dir / name) else None


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint to resume ``output_dir``'s run from: the one ``latest`` names if it is
    complete, else the complete ``checkpoint-N`` with the highest ``N``; ``None`` if there is none.

    Reads this process's view of the filesystem; ranks that must agree use :func:`resolve_resume`.
    """
    directory = Path(output_dir)
    pointed = _pointed(directory)
    if pointed is not None:
        return pointed
    numbered = _numbered(directory)
    return numbered[-1][1] if numbered else None


def _resolve_here(resume: str, output_dir: Path) -> str | None:
    """Rank 0's answer for :func:`resolve_resume`: the checkpoint's absolute path, or ``None``;
    :class:`CheckpointNotFoundError` when an explicit path cannot be resumed from."""
    if resume == AUTO:
        newest = newest_checkpoint(output_dir)
        return None if newest is None else str(newest.absolute())
    path = Path(resume).absolute()
    problem = _incomplete(path)
    if problem is not None:
        raise CheckpointNotFoundError(f"{path}: cannot resume from it: {problem}")
    return str(path)


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint a run resumes from: ``None`` for none; ``"auto"`` for
    :func:`newest_checkpoint` of ``output_dir`` (``None`` if it has none: start afresh); any other
    string is a checkpoint's path, which must be a complete checkpoint, else
    :class:`CheckpointNotFoundError` naming it.

    Every rank calls it and gets the same answer: rank 0 decides and broadcasts it (errors too).
    """
    if resume is None:
        return None
    decide = partial(_resolve_here, resume, Path(output_dir))
    found = RankGroup.job().on_rank_zero(
        "finding the checkpoint to resume from", decide, CheckpointNotFoundError, passed=(CheckpointNotFoundError,)
    )
    return None if found is None else Path(found)


def _delete(checkpoint: Path) -> None:
    """Remove a checkpoint, renamed aside first so a crash mid-way leaves no half of it under its name."""
    aside = checkpoint.parent / f".{checkpoint.name}.old-{secrets.token_hex(6)}"
    os.rename(checkpoint, aside)
    shutil.rmtree(aside)


def _point_and_prune(target: Path, keep_last: int | None) -> None:
    """Point ``latest`` at the just-written ``target``, then delete the complete ``checkpoint-N``
    folders beyond the newest ``keep_last`` (``target`` counting as the newest, and kept)."""
    write_text_atomically(target.parent / LATEST, target.name + "\n")
    if keep_last is None:
        return
    older = [path for _, path in _numbered(target.parent) if path.name != target.name and not path.is_symlink()]
    for path in older[: max(0, len(older) - (keep_last - 1))]:
        _delete(path)


class CheckpointRotation:
    """Resumable checkpoints of a run in ``output_dir``: ``checkpoint-{step}`` folders, ``latest``
    naming the newest, at most ``keep_last`` complete ones kept (``None``: all).

    Every rank constructs it and calls each method at the same point of the run. With
    ``asynchronous=True``, construction is collective too: it creates the process group the
    background writes use. Other folders and files in ``output_dir`` are never touched.
    """

    def __init__(self, output_dir: str | Path, keep_last: int | None, asynchronous: bool = False) -> None:
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise InvalidSetupError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        self.output_dir = Path(output_dir).absolute()
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        self._process_group = checkpoint_process_group() if asynchronous else None
        self._pending: PendingSave | None = None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data: Stateful | None = None) -> Path:
        """Save ``model``, ``optimizer``, ``step`` (and ``data``'s position) as
        ``checkpoint-{step}``; return its path.

        Synchronously the checkpoint is in place, ``latest`` names it and older ones are pruned
        when this returns. Asynchronously this first completes the previous save (as :meth:`wait`),
        then returns once the state is copied to memory; the new one is put in place later.
        Raises :class:`CheckpointSaveError` on every rank if a save failed: this one, or the
        previous background one (this one is then not started); the checkpoints in place stay.
        """
        target = self.output_dir / f"checkpoint-{step}"
        if not self.asynchronous:
            save_checkpoint(target, model, optimizer, step, data)
            self._publish(target)
            return target
        self.wait()
        self._pending = start_checkpoint_save(target, model, optimizer, step, data, self._process_group)
        return target

    def wait(self) -> Path | None:
        """Block until the pending background save is in place, ``latest`` names it and older ones
        are pruned; return its path (``None`` if none was pending). A run calls it before exiting.

        Raises :class:`CheckpointSaveError` on every rank if that save failed (it is then dropped).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.finish()
        self._publish(pending.target)
        return pending.target

    def close(self) -> None:
        """:meth:`wait`, then release the background writes' process group; no saves after it."""
        try:
            self.wait()
        finally:
            if self._process_group is not None:
                dist.destroy_process_group(self._process_group)
                self._process_group = None

    def _publish(self, target: Path) -> None:
        """Rank 0 updates ``latest`` and prunes once every rank's part is in; all learn the outcome."""
        publish = partial(_point_and_prune, target, self.keep_last)
        RankGroup.job().on_rank_zero("updating latest and pruning", publish, partial(save_failed, target))
