"""What killed saves leave behind, resolved when the next run starts.

A save writes into a hidden staging sibling and renames it into place; a replaced or pruned
checkpoint is renamed aside before it is deleted (:mod:`.atomic`, :mod:`.rotation`). A process
killed between those steps leaves ``.{name}.tmp-<hex>`` (a staging folder or file, never complete
as far as anyone may assume) or ``.{name}.old-<hex>`` (a checkpoint renamed aside). Nothing else
ever removes them, so they fill the disk, and an ``.old-`` folder may be the *only* complete copy
of its checkpoint: a crash between the two renames of a swap leaves ``name`` missing.

So a run starting in an output directory resolves them first (rank 0 decides and acts; every rank
learns what it did, and rank 0 says it): a ``.tmp-`` leftover is removed; an ``.old-`` folder is
moved back under its name when that name is missing and the folder holds a complete checkpoint
(DCP's ``.metadata``, or consolidated weights), and removed when its name exists again (the save
that replaced it finished). A complete checkpoint is never deleted: an ``.old-`` folder whose name
is missing and which is incomplete was half-way through a deletion already, and only that is
removed. The final save's staging sits beside the output directory, so its siblings named after it
are resolved too.
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass
from enum import Enum
from functools import partial
from pathlib import Path

from nemo_wrap.checkpoint.atomic import STAGING_NAME, save_failed
from nemo_wrap.checkpoint.locate import INDEX_FILE, SINGLE_FILE
from nemo_wrap.checkpoint.manifest import METADATA, checkpoint_layout
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointNotFoundError, CorruptCheckpointError


class LeftoverAction(Enum):
    """What is done with one leftover."""

    REMOVED = "removed"  # a killed save's staging, or a copy superseded by the checkpoint under its name
    RESTORED = "restored"  # the only complete copy of its checkpoint, moved back under its name


@dataclass(frozen=True)
class Leftover:
    """One leftover and what was done with it."""

    path: Path
    action: LeftoverAction
    why: str

    def describe(self) -> str:
        return f"{self.action.value} {self.path}: {self.why}"


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole checkpoint: a resumable one that passes its manifest check,
    consolidated weights, or (an output directory set aside whole) resumable checkpoints."""
    if (folder / METADATA).is_file():
        try:
            checkpoint_layout(folder)
        except (CorruptCheckpointError, CheckpointNotFoundError):
            return False
        return True
    weights = any((folder / name).is_file() for name in (SINGLE_FILE, INDEX_FILE))
    return weights or any((entry / METADATA).is_file() for entry in folder.iterdir() if entry.is_dir())


def _resolve(path: Path, kept_name: str, staging: bool) -> Leftover:
    """Resolve one leftover (``staging``: a ``.tmp-`` one) of the checkpoint ``kept_name``; act on
    it and say what was done."""
    original = path.parent / kept_name
    if staging:
        action, why = LeftoverAction.REMOVED, "the staging of a save that was killed"
    elif original.exists():
        action, why = LeftoverAction.REMOVED, f"an older copy of {kept_name}, which is in place"
    elif path.is_dir() and _complete(path):
        os.rename(path, original)
        return Leftover(path, LeftoverAction.RESTORED, f"the only complete copy of {kept_name}, back in place")
    else:
        action, why = LeftoverAction.REMOVED, f"an incomplete copy of {kept_name}, half deleted"
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    return Leftover(path, action, why)


def _resolve_all(output_dir: Path) -> list[Leftover]:
    """Rank 0's work for :func:`resolve_leftovers`: inside ``output_dir`` and beside it."""
    found = []
    inside = sorted(output_dir.iterdir()) if output_dir.is_dir() else []
    beside = sorted(output_dir.parent.glob(f".{glob.escape(output_dir.name)}.*")) if output_dir.parent.is_dir() else []
    for path in [*inside, *beside]:
        match = STAGING_NAME.fullmatch(path.name)
        if match is None or (path.parent != output_dir and match.group("name") != output_dir.name):
            continue  # beside the directory, only its own: ``.exp.v2.tmp-*`` belongs to ``exp.v2``'s run
        found.append(_resolve(path, match.group("name"), staging=match.group("kind") == "tmp"))
    return found


def resolve_leftovers(output_dir: str | Path) -> list[Leftover]:
    """Resolve the leftovers of killed saves in (and beside) ``output_dir``; return what was done,
    the same list on every rank. Collective: every rank calls it before the run reads checkpoints."""
    directory = Path(output_dir).absolute()
    return RankGroup.job().on_rank_zero(
        "resolving the leftovers of killed saves", partial(_resolve_all, directory), partial(save_failed, directory)
    )
