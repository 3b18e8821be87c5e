"""A validated view of one ``.safetensors`` file's header, and exact-byte reads of tensor blocks.

We parse the header ourselves (8-byte little-endian length, then JSON) instead of memory-mapping
the file: every structural fact (dtype, shape, offsets, sizes against the file length) is checked
up front with an error naming the file and key, and reads go through ``readinto`` into the final
tensor, so a rank touches only the bytes of its own shard and memory-mapped pages never inflate
its peak RSS.
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from nemo_wrap.checkpoint.strict_json import parse_json
from nemo_wrap.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from typing_extensions import Buffer

_DTYPES: dict[str, torch.dtype] = {
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
    dtype = _DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
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
    """Reads rectangular blocks of checkpoint tensors straight into destination tensors.

    Keeps one open handle per file and counts the bytes read per key (``bytes_read``), which the
    tests use to prove that every rank reads each byte it needs exactly once.
    """

    def __init__(self) -> None:
        self._handles: dict[Path, io.FileIO] = {}
        self.bytes_read: dict[str, int] = {}

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> BlockReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def read_block_into(self, entry: TensorEntry, block: tuple[slice, ...], out: torch.Tensor) -> None:
        """Copy ``tensor[block]`` (one step-1 slice per dim) of ``entry`` into ``out`` (same shape).

        Reads only the block's bytes: one contiguous run per index of the leading dims that the
        block does not cover whole. Converts dtype when ``out`` differs from the checkpoint.
        """
        shape = entry.shape
        ranges = [range(*s.indices(n)) for s, n in zip(block, shape, strict=False)]
        block_shape = tuple(len(r) for r in ranges)
        if tuple(out.shape) != block_shape:
            raise CorruptCheckpointError(
                f"{entry.file}: tensor {entry.key!r} block {block_shape} does not fit destination {tuple(out.shape)}"
            )
        if math.prod(block_shape) == 0:
            return
        element = torch.empty((), dtype=entry.dtype).element_size()
        # The innermost dims read whole form one contiguous run together with the first partial dim.
        run_dim = len(shape) - 1
        while run_dim > 0 and len(ranges[run_dim]) == shape[run_dim]:
            run_dim -= 1
        inner = math.prod(shape[run_dim + 1 :]) if shape else 1
        run_elements = len(ranges[run_dim]) * inner if shape else 1
        buffer = (
            out
            if (out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu")
            else torch.empty(block_shape, dtype=entry.dtype)
        )
        # numpy's stubs declare ``ndarray.__buffer__`` only for Python >= 3.12; the buffer protocol is there.
        target = memoryview(cast("Buffer", buffer.view(-1).view(torch.uint8).numpy()))
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        handle = self._handle(entry.file)
        written = 0
        for outer in itertools.product(*ranges[:run_dim]):
            flat = sum(i * s for i, s in zip(outer, strides, strict=False)) + (
                ranges[run_dim].start * strides[run_dim] if shape else 0
            )
            handle.seek(entry.start + flat * element)
            size = run_elements * element
            if handle.readinto(target[written : written + size]) != size:
                raise CorruptCheckpointError(f"{entry.file}: tensor {entry.key!r}: file ended while reading")
            written += size
        self.bytes_read[entry.key] = self.bytes_read.get(entry.key, 0) + written
        if buffer is not out:
            out.copy_(buffer)

    def _handle(self, path: Path) -> io.FileIO:
        if path not in self._handles:
            # Kept open across reads on purpose (one handle per file); closed by ``close``.
            self._handles[path] = open(path, "rb", buffering=0)  # noqa: SIM115
        return self._handles[path]
