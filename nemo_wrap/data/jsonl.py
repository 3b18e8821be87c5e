"""JSON Lines read line by line, so that every error names its line and no line can exhaust memory.

``datasets``' JSON builder (pyarrow underneath) reads a file in blocks: a malformed line surfaces as
a parse error of a block, without its line; one enormous line is read whole into memory before it
fails (a 10 GB line is 10 GB of RAM on every rank); rows whose fields differ in type fail as a
schema error. Fine-tuning files are small next to a model, so reading them here with
:func:`json.loads`, one bounded line at a time, costs nothing that matters and says exactly where a
file is wrong. Blank lines are allowed (editors and ``cat`` leave them); anything else must be a
JSON object.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_wrap.errors import ChatDataError

MAX_LINE_BYTES = 64 * 2**20  # far above any real example (a 32k-token conversation is ~150 KB)


@dataclass(frozen=True)
class JsonLines:
    """The objects of a JSON Lines file, each with the number of the line it was on (from 1)."""

    rows: list[dict[str, Any]]
    lines: list[int]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    @property
    def column_names(self) -> list[str]:
        """Every key any row has, in the order first seen."""
        return list(dict.fromkeys(key for row in self.rows for key in row))


def read_jsonl(path: Path) -> JsonLines:
    """Every object of ``path``; :class:`ChatDataError` naming the file and line for a line that is
    not a JSON object, not UTF-8, or longer than :data:`MAX_LINE_BYTES`, and for a file with none."""
    rows, lines = [], []
    with path.open("rb") as file:
        number = 0
        while line := file.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise ChatDataError(f"{path}: line {number}: longer than {MAX_LINE_BYTES:,} bytes; not read")
            if line.strip():
                rows.append(_parse(path, number, line))
                lines.append(number)
    if not rows:
        raise ChatDataError(f"{path}: no rows (the file is empty or blank)")
    return JsonLines(rows, lines)


def _parse(path: Path, number: int, line: bytes) -> dict[str, Any]:
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ChatDataError(f"{path}: line {number}: not UTF-8 (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ChatDataError(f"{path}: line {number}: not JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(value, dict):
        raise ChatDataError(f"{path}: line {number}: a JSON {type(value).__name__}, not an object (a row)")
    return value
