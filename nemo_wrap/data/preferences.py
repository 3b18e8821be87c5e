"""Preference pairs — a prompt, a chosen and a rejected completion — as rows the steps can score.

The formats TRL documents for its preference trainers, detected by their columns:

- conversational, explicit prompt: ``prompt`` a list of turns, ``chosen`` and ``rejected`` each
  one assistant turn (a list of one message);
- conversational, implicit prompt: ``chosen`` and ``rejected`` whole conversations that differ
  only in their last turn, an assistant turn; the turns before it are the prompt;
- plain text: ``prompt``, ``chosen`` and ``rejected`` strings.

Each pair is tokenized as TRL's ``DPOTrainer`` does: each sequence whole — a conversation's
rendering, a text's prompt, completion and end-of-sequence token — so the tokens at the seam are
the ones the model reads after that prompt; the prompt is the longest run of tokens the prompt
alone (a conversation's rendered with the generation prompt) shares with both sequences, and
labels (``-100`` elsewhere) are every token after it. One difference from TRL: the newline a
template writes after the end-of-turn token is not learned, as in chat SFT.

Truncation: a sequence longer than ``max_length`` keeps its prompt whole and loses the end of its
completion (each completion on its own); a pair whose prompt leaves no room for a completion
token is dropped, and counted. Pairs are never packed: the two sequences of a pair are two rows of
one batch, each padded to ``max_length``; a pair is scored from its own two rows only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from nemo_wrap.data.labels import IGNORE_INDEX, LabelledExample, render_chat
from nemo_wrap.data.packing import pack_examples
from nemo_wrap.data.rows import load_table, messages_problem
from nemo_wrap.errors import ChatTemplateError, PreferenceDataError

Batch = dict[str, torch.Tensor]


class PreferenceFormat(Enum):
    """How a preference data set's rows say prompt and completions."""

    CONVERSATIONAL = "conversational"  # lists of {role, content} turns (explicit or implicit prompt)
    TEXT = "text"  # strings


@dataclass(frozen=True)
class PreferencePair:
    """One pair's prompt and completions as they will be tokenized: message lists or strings."""

    prompt: Any
    chosen: Any
    rejected: Any


@dataclass(frozen=True)
class PreferenceRows:
    """Validated pairs of one format, where they came from, and where each one is (for errors)."""

    source: str
    format: PreferenceFormat
    pairs: tuple[PreferencePair, ...]
    locations: tuple[str, ...]


@dataclass(frozen=True)
class LabelledPair:
    """A pair's two sequences (prompt then completion), labels only on each completion."""

    chosen: LabelledExample
    rejected: LabelledExample

    @property
    def sequences(self) -> tuple[LabelledExample, LabelledExample]:
        return self.chosen, self.rejected


@dataclass(frozen=True)
class PreparedPairs:
    """The labelled pairs, and how many were truncated or dropped (no room for a completion)."""

    pairs: tuple[LabelledPair, ...]
    truncated: int
    dropped: int

    def summary(self) -> str:
        return f"{len(self.pairs)} preference pairs ({self.truncated} truncated, {self.dropped} dropped)"


def load_preference_rows(source: str | Path, columns: Mapping[str, str] | None = None) -> PreferenceRows:
    """Every pair of ``source`` (a local file or a hub data set id), validated: a bad row is a
    :class:`PreferenceDataError` naming the source and the line (JSON Lines) or row. ``columns``
    maps ours (``prompt``, ``chosen``, ``rejected``) to the data's (``{"chosen": "better"}``)."""
    table, locations = load_table(source)
    names = {ours: dict(columns or {}).get(ours, ours) for ours in ("prompt", "chosen", "rejected")}
    present = set(table.column_names)
    if not {names["chosen"], names["rejected"]} <= present:
        raise PreferenceDataError(
            f"{source}: columns {sorted(present)}: a preference set needs chosen and rejected (and prompt); "
            "map yours with columns={'chosen': ..., 'rejected': ...}"
        )
    table = [{ours: raw.get(theirs) for ours, theirs in names.items() if theirs in present} for raw in table]
    columns_here = {ours for ours, theirs in names.items() if theirs in present}
    pairs, formats = [], set()
    for raw, location in zip(table, locations, strict=True):
        pair, row_format, problem = _pair(raw, has_prompt="prompt" in columns_here)
        if problem is not None:
            raise PreferenceDataError(f"{source}: {location}: {problem}")
        pairs.append(pair)
        formats.add(row_format)
    if len(formats) > 1:
        raise PreferenceDataError(f"{source}: rows mix conversational and plain-text pairs; use one format")
    return PreferenceRows(str(source), formats.pop(), tuple(pairs), tuple(locations))


def _pair(raw: dict[str, Any], has_prompt: bool) -> tuple[PreferencePair, PreferenceFormat, str | None]:
    """One row as a pair and its format, or what is wrong with it."""
    prompt, chosen, rejected = raw.get("prompt"), raw.get("chosen"), raw.get("rejected")
    pair = PreferencePair(prompt, chosen, rejected)
    names = ("prompt", "chosen", "rejected") if has_prompt else ("chosen", "rejected")
    missing = [name for name in names if raw.get(name) is None]
    if missing:
        return pair, PreferenceFormat.CONVERSATIONAL, f"no {missing[0]}"
    if not has_prompt:
        return _implicit_prompt_pair(chosen, rejected)
    if all(isinstance(value, str) for value in (prompt, chosen, rejected)):
        empty = [name for name in ("prompt", "chosen", "rejected") if not raw[name].strip()]
        return pair, PreferenceFormat.TEXT, f"empty {empty[0]}" if empty else None
    if not all(isinstance(value, list) for value in (prompt, chosen, rejected)):
        return (
            pair,
            PreferenceFormat.CONVERSATIONAL,
            ("prompt, chosen and rejected must be all strings or all lists of {role, content} turns"),
        )
    return pair, PreferenceFormat.CONVERSATIONAL, _conversational_problem(prompt, chosen, rejected)


def _conversational_problem(prompt: Any, chosen: Any, rejected: Any) -> str | None:
    """A conversational pair's prompt must be turns, each completion one assistant turn."""
    problem = messages_problem(prompt)
    if problem is not None:
        return f"prompt: {problem}"
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        problem = messages_problem(completion)
        if problem is not None:
            return f"{name}: {problem}"
        if len(completion) != 1 or completion[0]["role"] != "assistant":
            return f"{name} must be one assistant turn (a list of one message)"
    return None


def _implicit_prompt_pair(chosen: object, rejected: object) -> tuple[PreferencePair, PreferenceFormat, str | None]:
    """Without a prompt column: two conversations whose turns before the last are the prompt."""
    empty = PreferencePair(None, chosen, rejected)
    for name, conversation in (("chosen", chosen), ("rejected", rejected)):
        problem = messages_problem(conversation)
        if problem is not None:
            return empty, PreferenceFormat.CONVERSATIONAL, f"{name}: {problem}"
    first, second = list(chosen), list(rejected)  # type: ignore[call-overload]
    if len(first) < 2 or first[:-1] != second[:-1]:
        return (
            empty,
            PreferenceFormat.CONVERSATIONAL,
            (
                "without a prompt column, chosen and rejected must be conversations that share every turn "
                "but the last (the prompt)"
            ),
        )
    if first[-1]["role"] != "assistant" or second[-1]["role"] != "assistant":
        return empty, PreferenceFormat.CONVERSATIONAL, "the last turn of chosen and rejected must be the assistant's"
    pair = PreferencePair(first[:-1], first[-1:], second[-1:])
    return pair, PreferenceFormat.CONVERSATIONAL, None


def prepare_pairs(rows: PreferenceRows, tokenizer: Any, max_length: int) -> PreparedPairs:
    """Tokenize and label every pair (module docstring: tokens, labels, truncation)."""
    pairs, truncated, dropped = [], 0, 0
    for pair, location in zip(rows.pairs, rows.locations, strict=True):
        try:
            prompt, chosen, rejected = _token_ids(rows.format, pair, tokenizer)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{rows.source}: {location}: {error}") from error
        if len(prompt) >= max_length:
            dropped += 1
            continue
        room = max_length - len(prompt)
        truncated += len(chosen) > room or len(rejected) > room
        pairs.append(LabelledPair(_labelled(prompt, chosen[:room]), _labelled(prompt, rejected[:room])))
    if not pairs:
        raise PreferenceDataError(f"{rows.source}: no pair has room for a completion (max_length={max_length})")
    return PreparedPairs(tuple(pairs), truncated, dropped)


def _labelled(prompt: list[int], completion: list[int]) -> LabelledExample:
    return LabelledExample(tuple(prompt + completion), (IGNORE_INDEX,) * len(prompt) + tuple(completion))


def _token_ids(format: PreferenceFormat, pair: PreferencePair, tokenizer: Any) -> tuple[list[int], ...]:
    """The prompt's token ids and each completion's, cut where the prompt's tokens end in both
    whole sequences (module docstring)."""
    if format is PreferenceFormat.TEXT:
        eos = tokenizer.eos_token or ""
        texts = (pair.prompt, pair.prompt + pair.chosen + eos, pair.prompt + pair.rejected + eos)
    else:
        texts = _conversation_texts(pair, tokenizer)
    prompt, chosen, rejected = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts)
    shared = min(_common_prefix(prompt, chosen), _common_prefix(prompt, rejected))
    return prompt[:shared], chosen[shared:], rejected[shared:]


def _common_prefix(first: list[int], second: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(len(first), len(second))
    )


def _conversation_texts(pair: PreferencePair, tokenizer: Any) -> tuple[str, str, str]:
    """The rendered prompt (with the generation prompt) and each whole conversation's rendering,
    through the completion's end-of-turn token (the newline after it is not learned)."""
    if tokenizer.chat_template is None:
        raise ChatTemplateError(f"{type(tokenizer).__name__} has no chat template; conversations need one")
    prompt = render_chat(tokenizer, pair.prompt, generation_prompt=True)
    wholes = []
    for completion in (pair.chosen, pair.rejected):
        whole = render_chat(tokenizer, [*pair.prompt, *completion], generation_prompt=False)
        if not whole.startswith(prompt):
            raise ChatTemplateError(
                "the chat template is not prefix-consistent: the prompt rendered with the generation prompt "
                "is not a prefix of the prompt and its completion rendered together"
            )
        wholes.append(whole.rstrip())
    return prompt, wholes[0], wholes[1]


def pair_rows(pairs: Sequence[LabelledPair], max_length: int, pad_token_id: int) -> list[Batch]:
    """One row per pair for :class:`~nemo_wrap.data.batches.DataParallelBatches`: ``input_ids``,
    ``labels`` and ``position_ids`` of shape ``[2, max_length]``, the chosen sequence first. A
    micro-batch of ``n`` pairs is then ``2n`` sequences, chosen and rejected alternating."""
    rows = []
    for pair in pairs:
        chosen, rejected = (pack_examples([sequence], max_length, pad_token_id)[0] for sequence in pair.sequences)
        rows.append({key: torch.cat([chosen[key], rejected[key]]) for key in chosen})
    return rows
