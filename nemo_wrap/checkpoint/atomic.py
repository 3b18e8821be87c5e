"""Replacing a checkpoint directory so that it holds either the old or the complete new checkpoint.

A save killed mid-write (OOM killer, preemption, SIGKILL) must not leave a half-written directory
where the next ``from_pretrained`` or resume would take it for a checkpoint, nor destroy the
checkpoint it was replacing. So the new checkpoint is written into a hidden sibling
(``.{name}.tmp-<random>``, same filesystem, so renames are metadata operations), every file and the
directory are fsynced, and only then is it swapped in.

``os.rename`` cannot replace a non-empty directory, so the swap is two renames: the existing
checkpoint aside (``.{name}.old-<random>``), the new one in, then the old one deleted. A crash in
the instant between the two renames leaves no directory at the target and the previous checkpoint
whole under its ``.old-`` name; a failing second rename puts the old one back.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

from nemo_wrap.errors import CheckpointSaveError


def stage_directory(target: Path, marker: str) -> Path:
    """Create and return an empty hidden sibling of ``target`` to write the new checkpoint into.

    The parent of ``target`` is created if needed. The swap replaces ``target`` as a whole, so an
    existing ``target`` must be a checkpoint of this kind (holding the file ``marker``) or empty:
    anything else (a file, a directory of other files) raises :class:`CheckpointSaveError`
    instead of being deleted.
    """
    if target.exists() and not (target.is_dir() and ((target / marker).exists() or not any(target.iterdir()))):
        raise CheckpointSaveError(
            f"{target}: exists and is neither empty nor a checkpoint (no {marker}); refusing to replace it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.parent / f".{target.name}.tmp-{secrets.token_hex(6)}"
    staged.mkdir()
    return staged


def replace_directory(staged: Path, target: Path) -> None:
    """Make the fully written ``staged`` directory durable and move it to ``target``.

    An existing ``target`` is moved aside first and deleted only once the new directory is in
    place; if moving the new one in fails, the old one is moved back.
    """
    _fsync_tree(staged)
    previous = None
    if target.exists():
        previous = target.parent / f".{target.name}.old-{secrets.token_hex(6)}"
        os.rename(target, previous)
    try:
        os.rename(staged, target)
    except BaseException:
        if previous is not None:
            os.rename(previous, target)
        raise
    _fsync(target.parent)
    if previous is not None:
        shutil.rmtree(previous)


def save_failed(target: Path, description: str) -> CheckpointSaveError:
    """The error every rank raises when writing the checkpoint at ``target`` failed."""
    return CheckpointSaveError(f"{target}: {description}")


def discard(staged: Path) -> None:
    """Remove a staging directory after a failed save (best effort: the failure is what matters)."""
    shutil.rmtree(staged, ignore_errors=True)


def _fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
