"""Resumable training checkpoints: model and optimizer state, sharded, through torch's DCP.

A consolidated transformers checkpoint (:mod:`nemo_wrap.checkpoint.save`) is for handing a model
on; resuming a run needs the optimizer state as well, and gathering every shard onto rank 0 would
cost memory and time for nothing. So each rank writes and reads its own shards with
``torch.distributed.checkpoint``; ``get_state_dict``/``set_state_dict`` give the model and
optimizer state in a form that is keyed by parameter name (not optimizer index) and works for
DDP, FSDP2, tensor parallel and both. The files hold each tensor's global shape and which part of
it each piece is, so a checkpoint resumes on another topology too — written by fsdp2 on 2 ranks, it
loads under fsdp2 on 4, fsdp2 × tp, tp alone, HSDP or in one process, and DCP reads each rank's
part of every tensor. What must stay the same is the model and the optimizer's kind and parameters.

A load refuses, on every rank and before reading any tensor, what it cannot load whole: a
directory whose files are not the ones its save wrote (:mod:`nemo_wrap.checkpoint.manifest`: a save
ends with a manifest of its files), and a checkpoint of another model or optimizer state, or of a
LoRA run into a model without adapters (:mod:`nemo_wrap.checkpoint.compatibility`).

The directory is replaced atomically like a consolidated save (:mod:`nemo_wrap.checkpoint.atomic`):
every rank writes into the staging directory rank 0 created, which needs a filesystem all ranks
share (as DCP's own file writer does).

A save can also run in the background (:func:`start_checkpoint_save`), so training goes on while
the files are written: the state is copied to memory first (the only pause training sees), then a
thread writes it. That thread's collectives must not share a process group with the training's —
two threads issuing collectives on one gloo group interleave them — so it gets a group of its own
(:func:`checkpoint_process_group`). The copy is agreed on before any thread starts
(:class:`AgreedCopy`): when it fails on one rank (out of memory), the others' writer threads would
otherwise wait in their first collective for a rank that never starts one, until the timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from nemo_wrap.checkpoint.atomic import discard, replace_directory, save_failed, staged_save
from nemo_wrap.checkpoint.compatibility import require_fit
from nemo_wrap.checkpoint.digest import DigestingWriter, Digests
from nemo_wrap.checkpoint.manifest import METADATA, Layout, checkpoint_layout, verify_contents, write_manifest
from nemo_wrap.distributed.collectives import RankGroup, is_multi_rank
from nemo_wrap.distributed.env import peers_must_answer
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptCheckpointError,
    DistributedStateError,
    PeerLostError,
    PeerTimeoutError,
)

_ERROR_CHARS = 2000  # DCP's exception lists every rank's traceback: enough of it to see the cause


def holds_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint :func:`save_checkpoint` finished writing."""
    return (directory / METADATA).is_file()


def _seal_and_move(staged: Path, target: Path, digests: Digests) -> None:
    """Rank 0, once every rank's files are in ``staged``: add the manifest, put it at ``target``."""
    write_manifest(staged, digests)
    replace_directory(staged, target)


def _training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, data: Stateful | None
) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step)}
    if data is not None:
        state["data"] = data
    return state


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data: Stateful | None = None,
) -> None:
    """Write ``model`` and ``optimizer`` state and ``step`` to ``directory``, replacing what is there.

    ``data`` (a ``Stateful``, e.g. :class:`nemo_wrap.data.batches.DataParallelBatches`) stores the
    position in the data too, so a resumed run sees the batches the uninterrupted one would have.

    Every rank calls it. Raises :class:`CheckpointSaveError` on every rank if any rank fails to
    write; the previous checkpoint at ``directory`` then stays in place.
    """
    target = Path(directory).absolute()
    group = RankGroup.job()  # DCP is collective over the job
    state = _training_state(model, optimizer, step, data)
    with staged_save(target, group) as (staged, failure):
        writer = DigestingWriter(staged)
        try:
            dcp.save(state, storage_writer=writer)
        except CheckpointException as error:  # raised on every rank when any rank failed
            raise failure(f"writing the sharded state failed: {error}") from error
        seal = partial(_seal_and_move, staged, target, writer.job_digests(group))
        group.on_rank_zero("moving the checkpoint into place", seal, failure)


def checkpoint_process_group() -> dist.ProcessGroup | None:
    """A new gloo group of every rank, for background checkpoint writes alone (``None`` in one
    process: nothing to coordinate). Collective: every rank calls it, once per group wanted."""
    return dist.new_group(backend="gloo") if is_multi_rank() else None


@dataclass(frozen=True)
class PendingSave:
    """A save :func:`start_checkpoint_save` began: its files are being written into ``staged``."""

    target: Path
    staged: Path
    step: int
    written: Future[Any]  # DCP's: done when this rank's files are written
    writer: DigestingWriter  # this rank's files' digests, once written
    group: RankGroup

    def finish(self) -> None:
        """Wait for this rank's write, then put the checkpoint at ``target`` (every rank calls it).

        Raises :class:`CheckpointSaveError` on every rank if any rank's write failed, and
        :class:`PeerLostError` (or :class:`PeerTimeoutError`) if a rank vanished (or hung) meanwhile;
        the staging directory is then removed and what was at ``target`` stays in place.
        """
        try:
            with peers_must_answer(f"finishing the background save of step {self.step}"):  # a dead peer is named
                self.group.on_every_rank("writing the sharded state", self._wait_for_write)
                seal = partial(_seal_and_move, self.staged, self.target, self.writer.job_digests(self.group))
                self.group.on_rank_zero("moving the checkpoint into place", seal, self._failure)
        except (CheckpointSaveError, PeerLostError, PeerTimeoutError):
            self._discard()
            raise
        except Exception as error:  # another rank's failure, or this rank's own
            self._discard()
            raise self._failure(f"writing the sharded state of step {self.step} failed: {error}") from error

    def _failure(self, description: str) -> CheckpointSaveError:
        return save_failed(self.target, description)

    def _wait_for_write(self) -> None:
        try:
            self.written.result()
        except CheckpointException as error:  # raised on every rank when any rank failed; a BaseException
            raise self._failure(f"writing the sharded state of step {self.step} failed: {error}") from error

    def _discard(self) -> None:
        if self.group.is_writer:
            discard(self.staged)


class AgreedCopy(AsyncStager):
    """DCP's own copy of the state to memory, followed by every rank agreeing that it succeeded.

    ``async_save`` calls :meth:`stage` in the calling thread and starts the writer thread after it
    returns; so a copy that failed anywhere raises on every rank here (one small all-reduce on the
    job's group, which no writer thread uses), and no writer thread starts anywhere.
    """

    _synchronize_after_execute = False

    def __init__(self, group: RankGroup) -> None:
        self._copy = DefaultStager(StagingOptions(False, False, False, False))  # a plain blocking copy to CPU
        self._group = group

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        copy = partial(cast("Callable[[dict[str, Any]], dict[str, Any]]", self._copy.stage), state_dict)
        try:
            return self._group.on_every_rank("copying the state to write", copy)
        finally:
            self._copy.close()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """Nothing to release: :meth:`stage` closes its copier."""


def start_checkpoint_save(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data: Stateful | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Begin :func:`save_checkpoint` in the background and return once the state is copied to memory.

    Training may go on at once (the copy is what gets written); the checkpoint is at ``directory``
    only after :meth:`PendingSave.finish`, which every rank must call before the next save and
    before exiting. ``process_group`` is the background write's own group, one that no other
    thread uses (:func:`checkpoint_process_group`); ``None`` only in one process
    (:class:`DistributedStateError` otherwise). Every rank calls it; raises
    :class:`CheckpointSaveError` on every rank if the write cannot be started.
    """
    target = Path(directory).absolute()
    group = RankGroup.job()
    if group.collective and process_group is None:
        raise DistributedStateError("a background save on several ranks needs its own process group")
    state = _training_state(model, optimizer, step, data)
    with staged_save(target, group) as (staged, failure):
        writer = DigestingWriter(staged)
        start = partial(
            dcp.async_save,
            state,
            storage_writer=writer,
            process_group=process_group,
            async_stager=AgreedCopy(group),
            no_dist=not group.collective,
        )
        try:
            # a Future: the stager copies before returning, so no staging future comes back
            written = cast("Future[Any]", group.on_every_rank("starting the background write", start))
        except Exception as error:
            raise failure(f"starting the background write failed: {error}") from error
    return PendingSave(target, staged, step, written, writer, group)


def load_checkpoint(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, data: Stateful | None = None
) -> int:
    """Restore ``model`` and ``optimizer`` (and ``data``'s position) from ``directory`` in place;
    return the saved step.

    Every rank calls it, with the model sharded in any way (the checkpoint is resharded onto it) and
    an optimizer of the same kind over the same parameters. Refuses on every rank, before anything
    is loaded: :class:`CheckpointNotFoundError` when ``directory`` holds no checkpoint written by
    :func:`save_checkpoint`; :class:`CorruptCheckpointError` naming the file when a file is
    missing, cut short, or not from this save (a read that fails later raises it too);
    :class:`CheckpointMismatchError` when the checkpoint is of another model or optimizer state.
    """
    path = Path(directory).absolute()
    group = RankGroup.job()  # DCP is collective over the job
    saved = _inspected(path, group)
    state = _training_state(model, optimizer, 0, data)  # filled in place by the load
    require_fit(path, saved, state, group)
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as error:  # raised on every rank when any rank's read failed
        raise CorruptCheckpointError(f"{path}: reading the checkpoint failed: {str(error)[:_ERROR_CHARS]}") from error
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])


def _inspected(path: Path, group: RankGroup) -> Layout:
    """The checkpoint's index, once rank 0 found its files sound; every rank gets the same answer,
    or raises the same error."""
    layout = group.on_rank_zero(
        "checking the checkpoint's files",
        partial(checkpoint_layout, path),
        partial(_unreadable, path),
        passed=(CheckpointNotFoundError, CorruptCheckpointError),
    )
    verify_contents(path, group)
    return layout


def _unreadable(path: Path, description: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {description}")
