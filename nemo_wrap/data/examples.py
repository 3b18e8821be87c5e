"""From validated rows to labelled examples of bounded length, with a count of what was cut."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_wrap.data.labels import IGNORE_INDEX, LabelledExample, label_conversation, label_prompt_completion, label_text
from nemo_wrap.data.packing import pack_examples
from nemo_wrap.data.rows import Rows
from nemo_wrap.errors import ChatDataError, ChatTemplateError


@dataclass(frozen=True)
class PreparedExamples:
    """The examples, and how many were truncated, dropped (too long, or nothing left to learn)."""

    examples: tuple[LabelledExample, ...]
    truncated: int = 0
    dropped: int = 0

    def summary(self) -> str:
        return f"{len(self.examples)} examples ({self.truncated} truncated, {self.dropped} dropped)"


def prepare_examples(
    rows: Rows, tokenizer: Any, max_length: int, overflow: str = "truncate", last_turn_only: bool = False
) -> PreparedExamples:
    """Label every row; an example longer than ``max_length`` is cut (``"truncate"``) or left out
    (``"drop"``). One whose labels are all cut away is left out too: it would teach nothing."""
    if overflow not in ("truncate", "drop"):
        raise ChatDataError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
    examples, truncated, dropped = [], 0, 0
    for index, row in enumerate(rows.rows):
        try:
            example = _label(rows.format, row, tokenizer, last_turn_only)
        except ChatTemplateError as error:  # named where it is, as a bad row is
            raise ChatTemplateError(f"{rows.source}: {rows.location(index)}: {error}") from error
        if len(example) > max_length:
            if overflow == "drop":
                dropped += 1
                continue
            example, truncated = example.truncated(max_length), truncated + 1
        if all(label == IGNORE_INDEX for label in example.labels[1:]):
            dropped += 1
            continue
        examples.append(example)
    if not examples:
        raise ChatDataError(f"{rows.source}: no example is left to learn from (max_length={max_length})")
    return PreparedExamples(tuple(examples), truncated, dropped)


def _label(format: str, row: dict[str, Any], tokenizer: Any, last_turn_only: bool) -> LabelledExample:
    if format == "messages":
        return label_conversation(tokenizer, row["messages"], last_turn_only)
    if format == "prompt_completion":
        return label_prompt_completion(tokenizer, row["prompt"], row["completion"])
    return label_text(tokenizer, row["text"])


def as_rows(examples: Sequence[LabelledExample], max_length: int, pad_token_id: int, pack: bool) -> list[dict]:
    """Fixed-length rows: several examples each when ``pack``, else one example per row, padded."""
    if pack:
        return pack_examples(examples, max_length, pad_token_id)
    return [pack_examples([example], max_length, pad_token_id)[0] for example in examples]
