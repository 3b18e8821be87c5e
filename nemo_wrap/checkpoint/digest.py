"""Content digests of checkpoint files, computed as the bytes are written, checked before a load.

Sizes catch a file cut short; they do not catch a flipped bit (a bad disk sector, a copy through
faulty memory, a storage system returning stale blocks). So every file a save writes is hashed
while it is written — the stream DCP (or our safetensors writer) writes into is wrapped by a
:class:`DigestingStream`, so nothing is read back — and the digests go into the manifest
(:mod:`.manifest`), which a load compares with the files before any tensor is read.

The hash is xxHash's XXH3 (64 bits, the ``xxhash`` package): a flipped bit must be found, not an
adversary resisted, and XXH3 does that at about 10 GB/s on one core of this machine, against
2.2 GB/s for zlib's CRC-32 and 1.1 GB/s for SHA-256 (measured on 256 MB) — so the digest costs a
few percent of a save, whose writes run at disk speed. 64 bits make a random match of a damaged
file 1 in 1.8e19.
"""

from __future__ import annotations

import io
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from nemo_wrap.distributed.collectives import RankGroup

DIGEST = "xxh3_64"  # the manifest's key for a file's digest

Digests = dict[str, str]  # file name → hex digest


class DigestingStream(io.RawIOBase):
    """A binary stream that passes writes on to ``raw`` and hashes every byte on the way."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self._hash = xxhash.xxh3_64()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        self._hash.update(view[:written] if written is not None else view)
        return len(view) if written is None else written

    def tell(self) -> int:
        return int(self.raw.tell())

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes, while ``raw`` is still open
        finally:
            self.raw.close()

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())


class DigestingFileSystem(FileSystem):
    """DCP's local file system, recording the digest of every file written through it."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: Digests = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = DigestingStream(raw)
            yield stream
            self.digests[Path(path).name] = stream.hexdigest()
            stream.close()  # DCP closes its data files' streams, not the one of .metadata

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata aside, then renames it
        if Path(path).name in self.digests:
            self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class DigestingWriter(FileSystemWriter):
    """DCP's file writer, hashing what it writes; :meth:`job_digests` gathers every rank's."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs: DigestingFileSystem = DigestingFileSystem()

    def job_digests(self, group: RankGroup) -> Digests:
        """The digests of every file every rank wrote (collective: every rank calls it)."""
        if not group.collective:
            return dict(self.fs.digests)
        gathered: list[Digests | None] = [None] * group.size
        dist.all_gather_object(gathered, self.fs.digests, group=group.process_group)
        return {name: digest for part in gathered for name, digest in (part or {}).items()}


def file_digest(path: Path) -> str:
    """The digest of ``path``'s bytes (for checking, never for a save). The file is mapped rather
    than read: hashing the page cache in place is 3-4× faster than copying it out in blocks
    (measured on 1.2 GB: 0.07-0.09 s against 0.22-0.32 s), which keeps a resume's check cheap."""
    with path.open("rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return str(xxhash.xxh3_64().hexdigest())
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return str(xxhash.xxh3_64(mapped).hexdigest())
