"""JSON from a checkpoint directory, parsed strictly and within a memory bound.

Headers, indexes and configs come from whoever published the checkpoint. Python's ``json`` keeps
the last of duplicate keys, recurses until ``RecursionError``, and builds 15–30 bytes of objects
per byte of input (a 100 MB header of empty objects peaks near 3 GB) before any check of ours
could run. So the size is bounded before reading, the number of opening brackets before parsing
(a byte count: cheap, and no real file comes near the bound even counting brackets inside
strings), and every failure is a :class:`CorruptCheckpointError` naming the file.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from nemo_wrap.errors import CorruptCheckpointError, summarize

# A safetensors header entry is at least ~48 bytes and holds one object and two arrays; a config or
# index holds far fewer. One bracket per 16 bytes is beyond anything real, and keeps the parsed
# objects within ~10x the input.
_BYTES_PER_CONTAINER = 16


def read_json_file(path: Path, what: str, max_bytes: int) -> object:
    """``path`` parsed by :func:`parse_json`, refused unread when larger than ``max_bytes``."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise CorruptCheckpointError(f"{path}: {what} of {size} bytes exceeds the {max_bytes >> 20} MiB limit")
        raw = path.read_bytes()
    except OSError as error:
        raise CorruptCheckpointError(f"{path}: cannot read the {what} ({error.strerror})") from error
    return parse_json(path, raw, what)


def parse_json(path: Path, raw: bytes, what: str) -> object:
    """JSON read from a checkpoint, strictly: UTF-8, no duplicate keys, bounded containers and numbers.

    Every failure (including Python's recursion and integer-size limits) is a
    :class:`CorruptCheckpointError` naming the file, never another exception.
    """
    brackets = raw.count(b"{") + raw.count(b"[")
    if brackets > len(raw) // _BYTES_PER_CONTAINER + 16:
        raise CorruptCheckpointError(
            f"{path}: {what} opens {brackets} JSON objects/arrays in {len(raw)} bytes; not a checkpoint's {what}"
        )

    def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
        result = dict(pairs)
        if len(result) != len(pairs):
            repeated = [key for key, count in Counter(key for key, _ in pairs).items() if count > 1]
            raise CorruptCheckpointError(f"{path}: {what} repeats the key(s) {summarize(repeated)}")
        return result

    try:
        return json.loads(raw, object_pairs_hook=unique)
    except CorruptCheckpointError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as error:
        detail = str(error)[:200]
        raise CorruptCheckpointError(f"{path}: {what} is not valid JSON ({type(error).__name__}: {detail})") from None
