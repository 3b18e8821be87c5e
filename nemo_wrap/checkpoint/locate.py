"""Find a checkpoint's files and index every tensor in them, refusing what is unsafe or broken.

Accepts a local directory or a hub model id (resolved through ``huggingface_hub``'s cache: the
local rank 0 downloads, the others wait and then read the cache). Every problem raises a specific
error naming the path, file or key; callers run this on every rank, so all ranks raise together.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from nemo_wrap.checkpoint.safetensors_file import TensorEntry, read_header
from nemo_wrap.checkpoint.strict_json import read_json_file
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_MAX_NAME = 4096  # PATH_MAX on Linux: a longer shard name cannot be a file
_MAX_INDEX_BYTES = 32 * 2**20  # ~300,000 keys; the largest published indexes hold ~100,000


@dataclass(frozen=True)
class Checkpoint:
    """Every tensor of a checkpoint directory: key → where its bytes are (or the tensor itself)."""

    directory: Path
    entries: dict[str, TensorEntry]
    pickle_tensors: dict[str, torch.Tensor] | None = None  # only for explicitly allowed .bin files


def resolve_checkpoint_directory(path_or_id: str | Path, group: RankGroup | None = None) -> Path:
    """A local directory as is; otherwise a hub id fetched (or found) in the huggingface cache.

    In a collective ``group`` the local rank 0 of each node downloads while the others wait; a
    process on its own (the default) fetches for itself.
    """
    if not isinstance(path_or_id, (str, os.PathLike)) or not str(path_or_id):
        raise CheckpointNotFoundError(f"expected a checkpoint directory or hub id, got {path_or_id!r}")
    path = Path(path_or_id).expanduser()
    try:
        if path.is_dir():
            return path
        if path.exists():
            raise CheckpointNotFoundError(f"{path}: is a file; pass the checkpoint directory")
    except OSError as error:  # a name too long, say
        raise CheckpointNotFoundError(f"{str(path)[:200]}: cannot be opened ({error.strerror})") from error
    text = str(path_or_id)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise CheckpointNotFoundError(f"{path_or_id}: no such directory (and not a hub id of the form 'org/name')")
    return _from_hub_cache(text, group or RankGroup.local())


def _from_hub_cache(repo_id: str, group: RankGroup) -> Path:
    import torch.distributed as dist
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]
    distributed = group.collective
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if distributed else 0
    error: Exception | None = None
    directory: str | None = None
    if local_rank == 0:
        try:
            directory = snapshot_download(repo_id, allow_patterns=patterns)
        except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as caught:
            error = caught
    if distributed:
        dist.barrier()  # the others wait for the local rank 0's download
    if local_rank != 0:
        try:
            directory = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
        except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as caught:
            error = caught
    if error is not None:
        raise CheckpointNotFoundError(_not_on_the_hub(repo_id, error))
    return Path(cast(str, directory))  # set on every rank that saw no error


def _not_on_the_hub(repo_id: str, error: Exception) -> str:
    """One line: where the copy was looked for, the hub's own reason (its first line), what to do."""
    from huggingface_hub import constants

    reason = next(iter(str(error).strip().splitlines()), "") or type(error).__name__
    return (
        f"{repo_id}: not a local directory, and the hub id cannot be resolved: no complete copy in the "
        f"Hugging Face cache {constants.HF_HUB_CACHE}, and the hub did not provide one ({reason}); "
        f"download it where the hub is reachable (`hf download {repo_id}` with the same HF_HOME) or pass "
        "the checkpoint's directory"
    )


def open_checkpoint(directory: Path, allow_pickle: bool = False) -> Checkpoint:
    """Index the weights in ``directory``: ``model.safetensors``, or the sharded index's files.

    Every file opened is the checkpoint's own (:func:`require_inside`).
    """
    if (directory / INDEX_FILE).is_file():
        require_inside(directory, INDEX_FILE)
        return Checkpoint(directory, _entries_from_index(directory))
    if (directory / SINGLE_FILE).is_file():
        require_inside(directory, SINGLE_FILE)
        return Checkpoint(directory, read_header(directory / SINGLE_FILE))
    pickles = [directory / name for name in PICKLE_FILES if (directory / name).is_file()]
    if pickles and not allow_pickle:
        raise UnsafeCheckpointError(
            f"{pickles[0]}: pickle checkpoints can run code when loaded and are refused; convert it to "
            "safetensors, or pass allow_pickle=True to load it with torch.load(weights_only=True)"
        )
    if pickles:
        require_inside(directory, pickles[0].name)
        return Checkpoint(directory, {}, _load_pickles(directory, pickles[0]))
    raise CheckpointNotFoundError(f"{directory}: no weight files (expected {SINGLE_FILE} or {INDEX_FILE})")


def _weight_map(index_path: Path) -> dict[str, str]:
    """An index file's key → shard file map, validated as JSON of the right shape and size."""
    index = read_json_file(index_path, "index", _MAX_INDEX_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{index_path}: not a valid index (needs a 'weight_map' object)")
    for key, file_name in weight_map.items():
        if not isinstance(file_name, str) or not file_name or "\0" in file_name or len(file_name) > _MAX_NAME:
            raise CorruptCheckpointError(
                f"{index_path}: key {key[:200]!r} names an invalid shard file {repr(file_name)[:200]}"
            )
    return weight_map


def _shard_path(index_path: Path, file_name: str, key: str) -> Path:
    """The shard an index names for ``key``: a file of the checkpoint (see :func:`_inside`), existing."""
    shard = index_path.parent / file_name
    if not _inside(index_path.parent, file_name):
        raise UnsafeCheckpointError(
            f"{index_path}: shard {file_name!r} of key {key!r} escapes the checkpoint directory"
        )
    if not _is_regular_file(shard):
        raise CheckpointNotFoundError(
            f"{index_path}: names shard {file_name!r} (for key {key!r}), which does not exist"
        )
    return shard.resolve()


def _is_regular_file(path: Path) -> bool:
    """A regular file (symlinks followed): not a FIFO, device or directory, nor an unusable name."""
    try:
        return path.is_file()
    except OSError:  # a component longer than the file system allows
        return False


def require_inside(directory: Path, name: str) -> None:
    """Raise :class:`UnsafeCheckpointError` unless ``directory / name`` is the checkpoint's own file."""
    if not _inside(directory, name):
        raise UnsafeCheckpointError(f"{directory / name}: resolves outside the checkpoint directory")


def _inside(directory: Path, name: str) -> bool:
    """Whether the file ``name`` (relative to ``directory``) belongs to the checkpoint there.

    Its name must stay inside the directory, and what it resolves to (symlinks followed) too — or,
    for a Hugging Face cache snapshot (``<repo>/snapshots/<rev>/``, whose files are symlinks to
    ``<repo>/blobs/``), inside that repository's own ``blobs`` folder.
    """
    try:
        root = directory.resolve()
        if root not in Path(os.path.normpath(root / name)).parents:  # "../x" and absolute names
            return False
        allowed = [root]
        if root.parent.name == "snapshots":
            allowed.append((root.parent.parent / "blobs").resolve())
        resolved = (directory / name).resolve()
    except (OSError, RuntimeError) as error:  # a name too long; a symlink loop (RuntimeError before 3.13)
        raise CheckpointNotFoundError(f"{directory / name[:200]}: cannot be resolved ({error})"[:400]) from error
    return any(base in resolved.parents for base in allowed)


def _entries_from_index(directory: Path) -> dict[str, TensorEntry]:
    index_path = directory / INDEX_FILE
    headers: dict[str, dict[str, TensorEntry]] = {}
    entries = {}
    for key, file_name in _weight_map(index_path).items():
        if file_name not in headers:
            headers[file_name] = read_header(_shard_path(index_path, file_name, key))
        if key not in headers[file_name]:
            raise CorruptCheckpointError(f"{index_path}: key {key!r} is mapped to {file_name}, which does not hold it")
        entries[key] = headers[file_name][key]
    return entries


def _load_pickles(directory: Path, first: Path) -> dict[str, torch.Tensor]:
    if first.name.endswith(".index.json"):
        shards = {file_name: _shard_path(first, file_name, key) for key, file_name in _weight_map(first).items()}
        paths = [shards[name] for name in sorted(shards)]
    else:
        paths = [first]
    tensors: dict[str, torch.Tensor] = {}
    for path in paths:
        tensors.update(_load_pickle(path))
    return tensors


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """One ``.bin`` file through ``weights_only`` unpickling: a dict of tensors, or a clear error."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, KeyError, AttributeError, OSError) as error:
        raise CorruptCheckpointError(f"{path}: not a loadable weights-only pickle ({type(error).__name__})") from error
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise CorruptCheckpointError(f"{path}: does not hold a dict of named tensors")
    return loaded
