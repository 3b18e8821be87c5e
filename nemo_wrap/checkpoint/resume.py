"""Resumable training checkpoints: model and optimizer state, sharded, through torch's DCP.

A consolidated transformers checkpoint (:mod:`nemo_wrap.checkpoint.save`) is for handing a model
on; resuming a run needs the optimizer state as well, and gathering every shard onto rank 0 would
cost memory and time for nothing. So each rank writes and reads its own shards with
``torch.distributed.checkpoint``; ``get_state_dict``/``set_state_dict`` give the model and
optimizer state in a form that is keyed by parameter name (not optimizer index) and works for
DDP, FSDP2, tensor parallel and both. The checkpoint resumes under the same strategy and world
size it was written with.

The directory is replaced atomically like a consolidated save (:mod:`nemo_wrap.checkpoint.atomic`):
every rank writes into the staging directory rank 0 created, which needs a filesystem all ranks
share (as DCP's own file writer does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from nemo_wrap.checkpoint.atomic import replace_directory, staged_save
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointNotFoundError

_METADATA_FILE = ".metadata"  # written by DCP's file writer once every rank's data is in


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
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step)}
    if data is not None:
        state["data"] = data
    with staged_save(target, group) as (staged, failure):
        try:
            dcp.save(state, checkpoint_id=staged)
        except CheckpointException as error:  # raised on every rank when any rank failed
            raise failure(f"writing the sharded state failed: {error}") from error
        group.on_rank_zero("moving the checkpoint into place", lambda: replace_directory(staged, target), failure)


def load_checkpoint(
    directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, data: Stateful | None = None
) -> int:
    """Restore ``model`` and ``optimizer`` (and ``data``'s position) from ``directory`` in place;
    return the saved step.

    Every rank calls it, with the model sharded as it was when saved. Raises
    :class:`CheckpointNotFoundError` when ``directory`` holds no checkpoint written by
    :func:`save_checkpoint`.
    """
    path = Path(directory)
    if not (path / _METADATA_FILE).is_file():
        raise CheckpointNotFoundError(f"{path}: no resumable checkpoint ({_METADATA_FILE} missing)")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model_state,
        "optimizer": optimizer_state,
        "step": torch.tensor(0, dtype=torch.int64),
    }
    if data is not None:
        state["data"] = data
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])
