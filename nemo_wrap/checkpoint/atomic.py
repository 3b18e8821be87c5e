"""Replacing a checkpoint directory so that it holds either the old or the complete new checkpoint.

A save killed mid-write (OOM killer, preemption, SIGKILL) must not leave a half-written directory
where the next ``from_pretrained`` or resume would take it for a checkpoint, nor destroy the
checkpoint it was replacing. So the new checkpoint is written into a hidden sibling
(``.{name}.tmp-<random>``, same filesystem, so renames are metadata operations), every file and the
directory are fsynced, and only then is it put in place:

- into a missing or empty directory, or over a directory that holds a previous checkpoint and
  nothing else, by swapping whole directories: two renames, the existing one aside
  (``.{name}.old-<random>``), the new one in, then the old one deleted. A crash between the two
  renames leaves the previous checkpoint whole under its ``.old-`` name; a failing second rename
  puts the old one back.
- into a directory that holds other things as well (a trainer's ``checkpoint-N/`` folders, notes),
  file by file, as transformers does: the previous checkpoint's weight files are removed, the new
  files moved in (each ``os.replace`` atomic), everything else left where it is. A crash in that
  short final step can leave old and new files side by side.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from functools import partial
from pathlib import Path

from nemo_wrap.checkpoint.manifest import MANIFEST, METADATA, WEIGHTS_MANIFEST
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointSaveError

# Files of a previous save that a new one supersedes (weights, their index, DCP's shards, its index
# and the manifest of them).
_WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json", "*.distcp", METADATA, MANIFEST, WEIGHTS_MANIFEST)
# The hidden siblings this module (and pruning) makes: ``.{name}.tmp-<hex>`` being written,
# ``.{name}.old-<hex>`` renamed aside to be deleted (:mod:`.leftovers` resolves those a crash left).
STAGING_NAME = re.compile(r"\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{12}")


def stage_directory(target: Path) -> Path:
    """Create and return an empty hidden sibling of ``target`` to write the new checkpoint into.

    The parent of ``target`` is created if needed; an existing ``target`` that is not a directory
    raises :class:`CheckpointSaveError` instead of being replaced.
    """
    if target.exists() and not target.is_dir():
        raise CheckpointSaveError(f"{target}: exists and is not a directory; refusing to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.parent / f".{target.name}.tmp-{secrets.token_hex(6)}"
    staged.mkdir()
    return staged


def replace_directory(staged: Path, target: Path) -> None:
    """Make the fully written ``staged`` directory durable and put its files at ``target``."""
    _fsync_tree(staged)
    if not target.exists() or _holds_only_a_checkpoint(target, {p.name for p in staged.iterdir()}):
        _swap(staged, target)
    else:
        _merge(staged, target)


def _is_weight_file(name: str) -> bool:
    return any(fnmatch(name, pattern) for pattern in _WEIGHT_FILES)


def _holds_only_a_checkpoint(target: Path, new_files: set[str]) -> bool:
    return all(
        entry.is_file() and (entry.name in new_files or _is_weight_file(entry.name)) for entry in target.iterdir()
    )


def _swap(staged: Path, target: Path) -> None:
    """Replace ``target`` by ``staged`` as a whole; the old one is deleted once the new one is in."""
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
    fsync(target.parent)
    if previous is not None:
        shutil.rmtree(previous)


def _merge(staged: Path, target: Path) -> None:
    """Move ``staged``'s files into ``target``, dropping its stale weight files, keeping the rest."""
    new_files = {p.name for p in staged.iterdir()}
    for entry in target.iterdir():
        if entry.is_file() and entry.name not in new_files and _is_weight_file(entry.name):
            entry.unlink()
    for name in sorted(new_files):
        os.replace(staged / name, target / name)
    fsync(target)
    staged.rmdir()


@contextmanager
def staged_save(target: Path, group: RankGroup) -> Iterator[tuple[Path, Callable[[str], CheckpointSaveError]]]:
    """A staging directory for ``target`` (made by the group's writer, every rank told the
    outcome), and the error to raise on every rank for a failed step. The block writes into it and
    puts it in place with :func:`replace_directory`; if the block raises, the writer removes it, so
    the previous checkpoint at ``target`` stays untouched."""
    failure = partial(save_failed, target)
    staged = group.on_rank_zero("creating the staging directory", lambda: stage_directory(target), failure)
    try:
        yield staged, failure
    except BaseException:
        if group.is_writer:
            discard(staged)
        raise


def save_failed(target: Path, description: str) -> CheckpointSaveError:
    """The error every rank raises when writing the checkpoint at ``target`` failed."""
    return CheckpointSaveError(f"{target}: {description}")


def discard(staged: Path) -> None:
    """Remove a staging directory after a failed save (best effort: the failure is what matters)."""
    shutil.rmtree(staged, ignore_errors=True)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace the small file ``path`` by ``text``: written aside, made durable, swapped in, so a
    reader sees the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    try:
        with open(temporary, "x", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync(path.parent)


def _fsync_tree(directory: Path) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fsync(Path(root) / name)
        fsync(Path(root))


def fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory: a rename inside it) to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
