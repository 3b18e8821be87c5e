"""A safetensors file written one tensor at a time, so a save never holds a file's worth of tensors.

``safetensors.torch.save_file`` takes every tensor of a file at once: a consolidated save of a large
model (a 50 GB shard by default) would first gather all of it on the writer. The format needs only
each tensor's dtype and shape up front — the header (8-byte little-endian length, JSON with
``data_offsets``, padded to 8 bytes) — and then the raw bytes in offset order. Shapes and dtypes
are known before any gather, so the header is written first and each tensor's bytes as it arrives.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from pathlib import Path

import torch

from nemo_wrap.checkpoint.digest import DigestingStream
from nemo_wrap.checkpoint.safetensors_file import DTYPES
from nemo_wrap.errors import CheckpointSaveError

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsStream:
    """Write ``layout`` (key → (shape, dtype), in file order) to ``path``: call :meth:`write` once
    per key, in that order, then :meth:`close`. A tensor that differs from its announced key, shape
    or dtype raises :class:`CheckpointSaveError` rather than writing a file that lies."""

    def __init__(self, path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, (shape, dtype) in layout.items():
            if dtype not in _NAMES:
                raise CheckpointSaveError(f"{path}: tensor {key!r} is {dtype}, which safetensors cannot store")
            size = dtype.itemsize * math.prod(shape)
            header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self._pending = list(layout.items())[::-1]
        self._path = path
        self._file = DigestingStream(path.open("wb"))  # hashed as written: the manifest's digest
        self._file.write(struct.pack("<Q", len(encoded)) + encoded)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected_key, (shape, dtype) = self._pending.pop() if self._pending else (None, ((), None))
        if key != expected_key or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointSaveError(
                f"{self._path}: got {key!r} {list(tensor.shape)} {tensor.dtype}, expected {expected_key!r} "
                f"{list(shape)} {dtype} next"
            )
        self._file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    @property
    def digest(self) -> str:
        """The content digest of what was written (:mod:`.digest`)."""
        return self._file.hexdigest()

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise CheckpointSaveError(f"{self._path}: {len(self._pending)} announced tensor(s) were never written")

    def abandon(self) -> None:
        """Close the file after a failure (the staged directory is discarded). Closing flushes what
        is still buffered, which fails again on a full disk: that second error is dropped, since the
        first is the one reported, and raising here would take the writer out of the gathers the
        other ranks are waiting in."""
        with contextlib.suppress(OSError):
            self._file.close()
