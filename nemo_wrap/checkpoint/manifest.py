"""Whether a resumable checkpoint's files are the ones its save wrote, checked before any tensor is read.

DCP's own load trusts the directory. A shard file cut short (a full disk, an interrupted copy), a
shard file that is gone, or a ``.metadata`` copied in from another save surfaces, if at all, as an
unpickling error deep inside a read — or, for the foreign ``.metadata`` of a run of the same model,
loads without a word. A resume has to refuse such a directory before any rank reads a tensor, and
name the file at fault.

So a save ends with a manifest (:data:`MANIFEST`), written by rank 0 into the staging directory
once DCP has finished and before the directory is moved into place: every file's name and exact
size, and the SHA-256 of ``.metadata`` — what ties DCP's index to these data files. A load checks
it against the directory (:func:`checkpoint_layout`), and then what the index itself allows: every
file it names exists and is long enough for every item it indexes. Checkpoints written before
manifests existed get these last checks alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_wrap.checkpoint.strict_json import read_json_file
from nemo_wrap.errors import CheckpointNotFoundError, CorruptCheckpointError

METADATA = ".metadata"  # written by DCP's file writer once every rank's data is in
MANIFEST = "nemo_wrap_manifest.json"
_FORMAT = "nemo_wrap resumable checkpoint manifest"
_VERSION = 1
_MAX_MANIFEST_BYTES = 16 * 2**20

# A checkpoint's index: each flattened state-dict key → its tensor's global shape, or None for a
# value stored as bytes (learning rates, a data loader's position).
Layout = dict[str, tuple[int, ...] | None]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(staged: Path) -> None:
    """Record the files DCP wrote into ``staged`` (rank 0, after the save, before the move)."""
    files = {p.name: p.stat().st_size for p in sorted(staged.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": _FORMAT, "version": _VERSION, "metadata_sha256": _sha256(staged / METADATA), "files": files}
    with (staged / MANIFEST).open("x", encoding="utf-8") as file:
        json.dump(manifest, file, indent=1, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())


def checkpoint_layout(directory: Path) -> Layout:
    """The index of the checkpoint in ``directory``, once its files are found to be the save's.

    Raises :class:`CheckpointNotFoundError` without ``.metadata``, and :class:`CorruptCheckpointError`
    naming the file when a file is missing, shorter or longer than written, or ``.metadata`` is not
    the one this save wrote or cannot be read.
    """
    if not (directory / METADATA).is_file():
        raise CheckpointNotFoundError(f"{directory}: no resumable checkpoint ({METADATA} missing)")
    if (directory / MANIFEST).is_file():
        _check_manifest(directory)
    metadata = _read_metadata(directory)
    _check_indexed_files(directory, metadata)
    return {
        key: tuple(item.size) if isinstance(item, TensorStorageMetadata) else None
        for key, item in metadata.state_dict_metadata.items()
    }


def _check_manifest(directory: Path) -> None:
    """``.metadata`` is the one this save wrote, and every file the manifest lists is there with
    its exact size."""
    files, digest = _read_manifest(directory / MANIFEST)
    if _sha256(directory / METADATA) != digest:
        raise CorruptCheckpointError(
            f"{directory / METADATA}: not the index this checkpoint was saved with (its SHA-256 differs from the "
            f"one in {MANIFEST}): it belongs to another save, and would read these files as that save's tensors"
        )
    for name, size in sorted(files.items()):
        _require_size(directory / name, size, exact=True, source=MANIFEST)


def _read_manifest(path: Path) -> tuple[dict[str, int], str]:
    """The manifest's files (name → size) and the SHA-256 of ``.metadata``, after checking its format."""
    manifest = read_json_file(path, "checkpoint manifest", _MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
        raise CorruptCheckpointError(f"{path}: not a version-{_VERSION} nemo_wrap checkpoint manifest")
    files, digest = manifest.get("files"), manifest.get("metadata_sha256")
    if (
        not isinstance(files, dict)
        or not isinstance(digest, str)
        or not all(_plain_name(name) and type(size) is int and size >= 0 for name, size in files.items())
    ):
        raise CorruptCheckpointError(f"{path}: 'files' must map file names to sizes, and 'metadata_sha256' be a string")
    return dict(files), digest


def _plain_name(name: object) -> bool:
    """Whether ``name`` is a file name within the checkpoint directory (no path, no ``..``)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "/" not in name


def _read_metadata(directory: Path) -> Metadata:
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as error:  # an unpickling failure has many types; each means the same here
        raise CorruptCheckpointError(
            f"{directory / METADATA}: DCP cannot read it ({type(error).__name__}: {str(error)[:200]})"
        ) from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, Mapping):
        raise CorruptCheckpointError(f"{directory / METADATA}: not the index of a DCP file-system checkpoint")
    return metadata


def _check_indexed_files(directory: Path, metadata: Metadata) -> None:
    """Every file the index names exists and holds every byte range the index reads from it."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name, end = _item_extent(directory, info)
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        _require_size(directory / name, end, exact=False, source=METADATA)


def _item_extent(directory: Path, info: object) -> tuple[str, int]:
    """The file an index entry reads from and the end of its byte range."""
    name, offset, length = (getattr(info, field, None) for field in ("relative_path", "offset", "length"))
    if not (isinstance(name, str) and _plain_name(name) and isinstance(offset, int) and isinstance(length, int)):
        raise CorruptCheckpointError(f"{directory / METADATA}: an entry names no file and byte range: {info!r}")
    return name, offset + length


def _require_size(path: Path, size: int, exact: bool, source: str) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing, though {source} names it") from None
    if actual < size or (exact and actual != size):
        wanted = f"{size} bytes were written" if exact else f"{source} reads up to byte {size}"
        raise CorruptCheckpointError(
            f"{path}: {actual} bytes, but {wanted} ({'truncated' if actual < size else 'changed since the save'})"
        )
