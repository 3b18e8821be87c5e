"""Whether a resumable checkpoint's files are the ones its save wrote, checked before any tensor is read.

DCP's own load trusts the directory. A shard file cut short (a full disk, an interrupted copy), a
shard file that is gone, or a ``.metadata`` copied in from another save surfaces, if at all, as an
unpickling error deep inside a read — or, for the foreign ``.metadata`` of a run of the same model,
loads without a word. A resume has to refuse such a directory before any rank reads a tensor, and
name the file at fault.

So a save ends with a manifest (:data:`MANIFEST`), written by rank 0 into the staging directory
once DCP has finished and before the directory is moved into place: every file's name, exact size
and content digest (:mod:`.digest`: XXH3, computed while the file was written). A load checks it
against the directory before reading any tensor: rank 0 the sizes and the digest of ``.metadata``
(:func:`checkpoint_layout`: what ties DCP's index to these data files), then every rank the
digests of its share of the data files (:func:`verify_contents`), and then what the index itself
allows: every file it names exists and is long enough for every item it indexes. Version-1
manifests (sizes, and the SHA-256 of ``.metadata``) are still checked as they were; checkpoints
written before manifests existed get the index checks alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from nemo_wrap.checkpoint.digest import DIGEST, Digests, file_digest
from nemo_wrap.checkpoint.strict_json import read_json_file
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.errors import CheckpointNotFoundError, CheckpointSaveError, CorruptCheckpointError

METADATA = ".metadata"  # written by DCP's file writer once every rank's data is in
MANIFEST = "nemo_wrap_manifest.json"
# A consolidated save's weight files with their sizes and digests (:func:`verify_weights`).
WEIGHTS_MANIFEST = "nemo_wrap_weights.json"
_WEIGHTS_FORMAT = "nemo_wrap consolidated weights manifest"
_FORMAT = "nemo_wrap resumable checkpoint manifest"
_VERSION = 2  # 2: each file's size and content digest; 1: sizes, and the SHA-256 of .metadata
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


@dataclass(frozen=True)
class FileRecord:
    """What the manifest says of one file: its size, and its content digest (``None``: version 1)."""

    size: int
    digest: str | None


def write_manifest(staged: Path, digests: Digests) -> None:
    """Record the files DCP wrote into ``staged`` with the digests taken while they were written
    (rank 0, after the save, before the move)."""
    files = {}
    for path in sorted(staged.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            if path.name not in digests:
                raise CheckpointSaveError(f"{path}: written without passing through the digesting writer")
            files[path.name] = {"size": path.stat().st_size, DIGEST: digests[path.name]}
    manifest = {"format": _FORMAT, "version": _VERSION, "files": files}
    with (staged / MANIFEST).open("x", encoding="utf-8") as file:
        json.dump(manifest, file, indent=1, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())


def write_weights_manifest(staged: Path, digests: Digests) -> None:
    """Record a consolidated save's weight files (``digests``: taken while each was written)."""
    files = {name: {"size": (staged / name).stat().st_size, DIGEST: digest} for name, digest in sorted(digests.items())}
    text = json.dumps({"format": _WEIGHTS_FORMAT, "version": 1, "files": files}, indent=1, sort_keys=True) + "\n"
    (staged / WEIGHTS_MANIFEST).write_text(text, encoding="utf-8")


def verify_weights(directory: Path) -> int:
    """Check a consolidated save's weight files against its weights manifest; return how many were
    checked (0: no manifest, a checkpoint from elsewhere). :class:`CorruptCheckpointError` names a
    file that is missing, of another size, or whose contents changed."""
    if not (directory / WEIGHTS_MANIFEST).is_file():
        return 0
    manifest = read_json_file(directory / WEIGHTS_MANIFEST, "weights manifest", _MAX_MANIFEST_BYTES)
    files = manifest.get("files") if isinstance(manifest, dict) and manifest.get("format") == _WEIGHTS_FORMAT else None
    records = {name: _record(entry) for name, entry in files.items()} if isinstance(files, dict) else {}
    if not records or not all(_plain_name(name) and record for name, record in records.items()):
        raise CorruptCheckpointError(f"{directory / WEIGHTS_MANIFEST}: not a nemo_wrap weights manifest")
    for name, record in sorted(records.items()):
        assert record is not None and record.digest is not None  # checked above
        _require_size(directory / name, record.size, exact=True, source=WEIGHTS_MANIFEST)
        problem = _content_problem(directory / name, record.digest, WEIGHTS_MANIFEST)
        if problem is not None:
            raise CorruptCheckpointError(problem)
    return len(records)


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
    its exact size (the data files' contents are :func:`verify_contents`'s)."""
    files, metadata_sha256 = _read_manifest(directory / MANIFEST)
    if METADATA in files and files[METADATA].digest is not None:
        same_index = file_digest(directory / METADATA) == files[METADATA].digest
    else:
        same_index = metadata_sha256 is None or _sha256(directory / METADATA) == metadata_sha256
    if not same_index:
        raise CorruptCheckpointError(
            f"{directory / METADATA}: not the index this checkpoint was saved with (its digest differs from the "
            f"one in {MANIFEST}): it belongs to another save, and would read these files as that save's tensors"
        )
    for name, record in sorted(files.items()):
        _require_size(directory / name, record.size, exact=True, source=MANIFEST)


def verify_contents(directory: Path, group: RankGroup) -> None:
    """Every data file's content digest equals the manifest's; raises :class:`CorruptCheckpointError`
    naming the first file that differs, on every rank. The files are shared out over the ranks,
    each hashing its share (collective: every rank calls it, after :func:`checkpoint_layout`)."""
    if not (directory / MANIFEST).is_file():
        return
    files, _ = _read_manifest(directory / MANIFEST)
    names = [name for name, record in sorted(files.items()) if record.digest is not None]
    problem = None
    for name in names[group.rank :: group.size]:
        problem = _content_problem(directory / name, files[name].digest, MANIFEST)
        if problem is not None:
            break
    problems: list[str | None] = [problem]
    if group.collective:
        problems = [None] * group.size
        dist.all_gather_object(problems, problem, group=group.process_group)
    found = sorted(p for p in problems if p is not None)
    if found:
        raise CorruptCheckpointError(found[0])


def _content_problem(path: Path, digest: str | None, manifest: str) -> str | None:
    """What is wrong with ``path``'s contents (``None``: its digest is the manifest's). A file that
    cannot be read is a problem to report, not an error to raise: in :func:`verify_contents` the
    other ranks are waiting for this rank's answer."""
    try:
        same = file_digest(path) == digest
    except OSError as error:
        return f"{path}: cannot be read to check its contents ({error.strerror or error})"
    if same:
        return None
    return (
        f"{path}: its contents changed since the save (its {DIGEST} digest differs from the one in {manifest}, "
        f"though its size is the same): damaged on disk or in a copy"
    )


def _read_manifest(path: Path) -> tuple[dict[str, FileRecord], str | None]:
    """The manifest's files and (version 1) the SHA-256 of ``.metadata``, after checking its format."""
    manifest = read_json_file(path, "checkpoint manifest", _MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or manifest.get("version") not in (1, 2):
        raise CorruptCheckpointError(f"{path}: not a version-1 or -2 nemo_wrap checkpoint manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(_plain_name(name) for name in files):
        raise CorruptCheckpointError(f"{path}: 'files' must map file names to what was written")
    if manifest["version"] == 1:
        return _version_1(path, files, manifest.get("metadata_sha256"))
    records = {name: _record(entry) for name, entry in files.items()}
    if not all(records.values()):
        raise CorruptCheckpointError(f"{path}: each file's entry must hold its 'size' and '{DIGEST}' digest")
    return {name: record for name, record in records.items() if record is not None}, None


def _version_1(path: Path, files: dict[str, Any], digest: object) -> tuple[dict[str, FileRecord], str | None]:
    if not isinstance(digest, str) or not all(type(size) is int and size >= 0 for size in files.values()):
        raise CorruptCheckpointError(f"{path}: 'files' must map file names to sizes, and 'metadata_sha256' be a string")
    return {name: FileRecord(size, None) for name, size in files.items()}, digest


def _record(entry: object) -> FileRecord | None:
    if not isinstance(entry, dict):
        return None
    size, digest = entry.get("size"), entry.get(DIGEST)
    if type(size) is not int or size < 0 or not isinstance(digest, str):
        return None
    return FileRecord(size, digest)


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
