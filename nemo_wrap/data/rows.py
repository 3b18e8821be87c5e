"""Rows of a fine-tuning data set, loaded with ``datasets`` and validated one by one.

Three formats: ``messages`` (a list of ``{"role", "content"}`` turns: system, user, assistant),
``prompt`` + ``completion``, and plain ``text``. ``format="auto"`` picks the one whose columns the
data has; ``columns`` maps other column names onto these. A bad row raises
:class:`ChatDataError` naming the source and the row, or — with ``skip_bad_rows`` — is skipped
and counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_wrap.data.jsonl import read_jsonl
from nemo_wrap.errors import ChatDataError

FORMATS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_ROLES = ("system", "user", "assistant")


@dataclass
class Rows:
    """Validated rows of one format, where they came from, and how many bad rows were skipped."""

    source: str
    format: str
    rows: list[dict[str, Any]]
    skipped: dict[int, str] = field(default_factory=dict)  # row index → why
    locations: list[str] = field(default_factory=list)  # where each kept row is: "line 7" (JSON Lines), "row 6"

    def location(self, index: int) -> str:
        """Where kept row ``index`` came from, for an error message about it."""
        return self.locations[index] if index < len(self.locations) else f"row {index}"


def load_rows(
    source: str | Path,
    format: str = "auto",
    columns: Mapping[str, str] | None = None,
    split: str = "train",
    skip_bad_rows: bool = False,
) -> Rows:
    """Load ``source`` (a local file, or a hub dataset id through the ``datasets`` cache).

    ``columns`` maps our column names to the data's (``{"prompt": "question"}``).
    """
    table, locations = load_table(source, split)
    columns = dict(columns or {})
    chosen = _choose_format(str(source), format, table.column_names, columns)
    wanted = {ours: columns.get(ours, ours) for ours in FORMATS[chosen]}
    result = Rows(str(source), chosen, [])
    for index, (raw, location) in enumerate(zip(table, locations, strict=True)):
        row = {ours: raw.get(theirs) for ours, theirs in wanted.items()}
        problem = _problem(chosen, row)
        if problem is None:
            result.rows.append(row)
            result.locations.append(location)
        elif skip_bad_rows:
            result.skipped[index] = problem
        else:
            raise ChatDataError(f"{source}: {location}: {problem} (pass skip_bad_rows=True to skip such rows)")
    return result


def load_table(source: str | Path, split: str = "train") -> tuple[Any, list[str]]:
    """The rows of ``source`` (with ``column_names``) and where each is, for error messages: a JSON
    Lines file by line (:mod:`.jsonl`), anything else by row."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".jsonl":
        lines = read_jsonl(path)
        return lines, [f"line {number}" for number in lines.lines]
    table = _load_with_datasets(source, path, split)
    return table, [f"row {index}" for index in range(len(table))]


def _load_with_datasets(source: str | Path, path: Path, split: str) -> Any:
    import datasets

    try:
        if path.is_file():
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ChatDataError(f"{path}: unknown data file type (expected one of {sorted(_BUILDERS)})")
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if path.exists():
            raise ChatDataError(f"{path}: not a data file")
        return datasets.load_dataset(str(source), split=split)
    except ChatDataError:
        raise
    except Exception as error:  # datasets raises many kinds (missing file, parse errors, hub errors)
        raise ChatDataError(f"{source}: cannot be loaded as a data set ({type(error).__name__}: {error})") from error


def _choose_format(source: str, format: str, column_names: list[str], columns: dict[str, str]) -> str:
    def has(fmt: str) -> bool:
        return all(columns.get(ours, ours) in column_names for ours in FORMATS[fmt])

    if format == "auto":
        for candidate in FORMATS:
            if has(candidate):
                return candidate
        raise ChatDataError(
            f"{source}: columns {column_names} fit no format (messages; prompt + completion; text); "
            "map yours with columns={'prompt': 'your_column', ...}"
        )
    if format not in FORMATS:
        raise ChatDataError(f"format must be 'auto' or one of {sorted(FORMATS)}, got {format!r}")
    if not has(format):
        missing = [columns.get(o, o) for o in FORMATS[format] if columns.get(o, o) not in column_names]
        raise ChatDataError(f"{source}: format {format!r} needs column(s) {missing}; it has {column_names}")
    return format


def _problem(format: str, row: dict[str, Any]) -> str | None:
    """What is wrong with one row, or None."""
    if format == "messages":
        return _conversation_problem(row["messages"])
    texts = [row[name] for name in FORMATS[format]]
    if not all(isinstance(text, str) for text in texts):
        return f"{', '.join(FORMATS[format])} must be strings"
    if not texts[-1].strip():
        return f"empty {FORMATS[format][-1]}"
    return None


def _conversation_problem(messages: object) -> str | None:
    problem = messages_problem(messages)
    if problem is None and not any(message["role"] == "assistant" for message in messages):  # type: ignore[attr-defined]
        return "no assistant turn: nothing to learn"
    return problem


def messages_problem(messages: object) -> str | None:
    """What is wrong with a list of ``{role, content}`` turns, or None: it must be non-empty, each
    turn a known role with string content, no assistant turn empty."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content} turns"
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return f"turn {turn} is not a {{role, content}} message with string content"
        if message.get("role") not in _ROLES:
            return f"turn {turn} has role {message.get('role')!r}; roles are {list(_ROLES)}"
        if message["role"] == "assistant" and not message["content"].strip():
            return f"turn {turn} is an empty assistant turn"
    return None
