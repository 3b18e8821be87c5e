"""A validated view of one ``.safetensors`` file's header, and exact-byte reads of tensor blocks.

We parse the header ourselves (8-byte little-endian length, then JSON) rather than trusting a
library's parser: every structural fact (dtype, shape, offsets, sizes against the file length) is
checked up front with an error naming the file and key. Only then are the files mapped, and
:class:`BlockReader` copies each rank's blocks out of the mapping into their final tensors.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_wrap.checkpoint.strict_json import parse_json
from nemo_wrap.errors import CorruptCheckpointError

# The format's dtype names (the writer inverts this table).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# The format allows 100 MB, which Python's json turns into gigabytes. 16 MiB is ~150,000 tensors in
# one file; real shards hold hundreds to a few thousand.
_MAX_HEADER_BYTES = 16 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and absolute byte range in the file."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and validate ``path``'s header; raise :class:`CorruptCheckpointError` naming the fault."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CorruptCheckpointError(
                    f"{path}: truncated safetensors file ({file_size} bytes, no header length)"
                )
            header_size = int.from_bytes(prefix, "little")
            if header_size > file_size - 8:
                raise CorruptCheckpointError(
                    f"{path}: header length {header_size} exceeds the file ({file_size} bytes): "
                    "truncated or not safetensors"
                )
            if header_size > _MAX_HEADER_BYTES:
                raise CorruptCheckpointError(
                    f"{path}: header of {header_size} bytes exceeds the {_MAX_HEADER_BYTES >> 20} MiB limit"
                )
            raw = handle.read(header_size)
    except OSError as error:
        raise CorruptCheckpointError(f"{path}: cannot read ({error.strerror})") from error
    header = parse_json(path, raw, "header")
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: header is not a JSON object")
    _check_metadata(path, header.pop("__metadata__", {}))
    data_start = 8 + header_size
    entries = {key: _validated_entry(path, key, info, data_start, file_size) for key, info in header.items()}
    _check_contiguous(path, entries, data_start, file_size)
    return entries


def _check_metadata(path: Path, metadata: object) -> None:
    """``__metadata__`` is a string → string object, as the safetensors format defines it."""
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{path}: __metadata__ must map strings to strings")


def _validated_entry(path: Path, key: str, info: object, data_start: int, file_size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CorruptCheckpointError(f"{path}: tensor {key!r} lacks dtype/shape/data_offsets")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has unsupported dtype {info['dtype']!r}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has invalid shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptCheckpointError(f"{path}: tensor {key!r} has invalid data_offsets {offsets!r}")
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes != expected:
        raise CorruptCheckpointError(
            f"{path}: tensor {key!r} spans {nbytes} bytes but dtype {info['dtype']} × shape {shape} needs {expected}"
        )
    if data_start + offsets[1] > file_size:
        raise CorruptCheckpointError(
            f"{path}: tensor {key!r} ends at byte {data_start + offsets[1]} but the file has {file_size}: truncated"
        )
    return TensorEntry(path, key, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _check_contiguous(path: Path, entries: dict[str, TensorEntry], data_start: int, file_size: int) -> None:
    """Tensor bytes follow each other exactly, from the header's end to the file's end: no overlap
    (zero-size tensors included), no gap, nothing trailing — as the reference parser requires."""
    expected, previous = data_start, "the header"
    for entry in sorted(entries.values(), key=lambda e: (e.start, e.nbytes)):
        if entry.start != expected:
            how = "overlap" if entry.start < expected else "leave a gap between them"
            raise CorruptCheckpointError(f"{path}: tensors {previous} and {entry.key!r} {how}")
        expected, previous = entry.start + entry.nbytes, repr(entry.key)
    if expected != file_size:
        raise CorruptCheckpointError(f"{path}: {file_size - expected} byte(s) after the last tensor")


class BlockReader:
    """Rectangular blocks of checkpoint tensors, as views to copy straight into destination tensors.

    Each file is memory-mapped once (copy-on-write, so nothing can write back to it) and seen as a
    byte tensor; a block is a view of the mapping, and the loader makes it one ``copy_`` into the
    destination. That is a
    single copy out of the page cache on torch's intra-op threads, with any dtype conversion done in
    the same pass (bf16 → fp32 needs no staging tensor), and the destination may be strided (a row
    range of a fused parameter). ``readinto`` was a single-threaded kernel copy plus a second copy
    for every non-contiguous or converted block: twice the floor on a 2-core machine. After each
    block its pages are dropped from the mapping, so mapped pages never pile up in the resident
    set: a rank's peak holds its own shards, not the files it read them from.

    Counts the bytes of every block handed out per key (``bytes_read``), which the tests use to
    prove that every rank reads each byte it needs exactly once.
    """

    def __init__(self) -> None:
        self._files: dict[Path, _MappedFile] = {}
        self.bytes_read: dict[str, int] = {}
        self._held: list[tuple[_MappedFile, TensorEntry, torch.Tensor]] | None = None

    def close(self) -> None:
        self._files.clear()  # the last reference to a mapping unmaps it

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextmanager
    def block(self, entry: TensorEntry, window: tuple[slice, ...]) -> Iterator[torch.Tensor]:
        """``tensor[window]`` of ``entry`` as a view of the mapped file, valid inside the block; its
        pages are dropped from the resident set afterwards and its bytes counted as read."""
        with self.reread(entry, window) as view:
            yield view
        self.bytes_read[entry.key] = self.bytes_read.get(entry.key, 0) + view.numel() * entry.dtype.itemsize

    @contextmanager
    def reread(self, entry: TensorEntry, window: tuple[slice, ...]) -> Iterator[torch.Tensor]:
        """:meth:`block` for ``verify``'s second read: the same view and page dropping, not counted
        in ``bytes_read`` (which is what the load read)."""
        mapped = self._mapped(entry.file)
        view = mapped.tensor(entry)[window]
        try:
            yield view
        finally:
            if self._held is None:
                mapped.drop_pages(entry, view)
            else:
                self._held.append((mapped, entry, view))

    @contextmanager
    def pages_held(self) -> Iterator[None]:
        """Keep the pages of the blocks handed out inside mapped until it ends, so a second look at
        the same bytes (``verify``'s, right after a tensor is read) costs no page faults."""
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            for mapped, entry, view in held:
                mapped.drop_pages(entry, view)

    def _mapped(self, path: Path) -> _MappedFile:
        if path not in self._files:
            self._files[path] = _MappedFile(path)
        return self._files[path]


class _MappedFile:
    """One checkpoint file mapped copy-on-write and viewed as a byte tensor.

    The tensor view holds the mapping's buffer, so the mapping lives exactly as long as the view and
    its slices: dropping the last reference unmaps it (no ``close`` that could fail while a slice is
    still referenced from a traceback).
    """

    def __init__(self, path: Path) -> None:
        try:
            with open(path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as error:
            raise CorruptCheckpointError(f"{path}: cannot map the file ({error})") from error
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def tensor(self, entry: TensorEntry) -> torch.Tensor:
        """``entry`` as a tensor of its dtype and shape over the mapping (no copy when aligned)."""
        raw = self._bytes[entry.start : entry.start + entry.nbytes]
        if entry.start % entry.dtype.itemsize:  # the format does not promise alignment: stage this one
            raw = raw.clone()
        return raw.view(entry.dtype).view(entry.shape)

    def drop_pages(self, entry: TensorEntry, view: torch.Tensor) -> None:
        """Release from this process's resident set the pages ``view`` (a window of ``entry``) spans."""
        start = view.data_ptr() - self._bytes.data_ptr()
        if not 0 <= start < len(self._map):  # a staged copy of the entry: all of it was read
            start, stop = entry.start, entry.start + entry.nbytes
        else:
            extent = sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
            stop = start + (extent + 1) * view.element_size() if view.numel() else start
        first = start - start % mmap.PAGESIZE
        if stop > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, min(stop, len(self._map)) - first)
