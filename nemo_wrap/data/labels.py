"""Tokens and labels for one example, with the tokenizer's own chat template.

Labels are ``-100`` everywhere except what the assistant says **and the token that ends its turn**
(``<|im_end|>``, ``<|eot_id|>``): a model never trained on that token never learns to stop. Where
the template marks assistant text with ``{% generation %}``, its mask is used; otherwise each
assistant turn is located by rendering the conversation up to it, which is only sound when every
rendered prefix is a prefix of the whole rendering — a template where that fails (one that
rewrites earlier turns, say) is refused rather than mislabelled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_wrap.errors import ChatTemplateError

IGNORE_INDEX = -100
Message = dict[str, str]
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class LabelledExample:
    """One example's token ids and labels (same length; ``-100`` where nothing is learned)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.input_ids)

    def truncated(self, length: int) -> LabelledExample:
        return LabelledExample(self.input_ids[:length], self.labels[:length])


def label_conversation(tokenizer: Any, messages: Sequence[Message], last_turn_only: bool = False) -> LabelledExample:
    """Tokenize ``messages`` with the chat template; label every assistant turn (or the last)."""
    if tokenizer.chat_template is None:
        raise ChatTemplateError(f"{type(tokenizer).__name__} has no chat template; conversations need one")
    if _GENERATION_TAG.search(tokenizer.chat_template):
        return _label_generation_mask(tokenizer, messages, last_turn_only)
    text = render_chat(tokenizer, messages, generation_prompt=False)
    spans = _assistant_spans(tokenizer, messages, text)
    if last_turn_only:
        spans = spans[-1:]
    return _label_spans(tokenizer, text, spans)


def label_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> LabelledExample:
    """``prompt`` then ``completion`` and the end-of-sequence token; the completion and EOS are learned."""
    eos = tokenizer.eos_token or ""
    return _label_spans(tokenizer, prompt + completion + eos, [(len(prompt), len(prompt) + len(completion) + len(eos))])


def label_text(tokenizer: Any, text: str) -> LabelledExample:
    """Plain text, every token learned (then the end-of-sequence token)."""
    full = text + (tokenizer.eos_token or "")
    return _label_spans(tokenizer, full, [(0, len(full))])


def _label_generation_mask(tokenizer: Any, messages: Sequence[Message], last_turn_only: bool) -> LabelledExample:
    """The template's own assistant mask, each run extended by the special token that follows it
    when the template leaves the end-of-turn token outside ``{% generation %}``."""
    try:
        encoded = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as error:
        raise ChatTemplateError(f"the chat template cannot render this conversation: {error}") from error
    ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
    special = set(tokenizer.all_special_ids)
    runs, start = [], None
    for index, flag in enumerate([*mask, 0]):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            end = index + 1 if index < len(ids) and ids[index] in special else index
            runs.append((start, end))
            start = None
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in runs[-1:] if last_turn_only else runs:
        labels[start:end] = ids[start:end]
    return LabelledExample(tuple(ids), tuple(labels))


def render_chat(tokenizer: Any, messages: Sequence[Message], generation_prompt: bool) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
        )
    except Exception as error:  # jinja raises what the template raises (raise_exception, undefined names)
        raise ChatTemplateError(f"the chat template cannot render this conversation: {error}") from error


def _assistant_spans(tokenizer: Any, messages: Sequence[Message], text: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn's content and end-of-turn token in ``text``."""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:index], generation_prompt=True) if index else ""
        through = render_chat(tokenizer, messages[: index + 1], generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ChatTemplateError(
                f"the chat template is not prefix-consistent at message {index}: rendering the conversation "
                "up to a turn is not a prefix of rendering all of it, so assistant turns cannot be located"
            )
        spans.append((len(before), len(through.rstrip())))  # the template's newline after the turn is not learned
    return spans


def _label_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> LabelledExample:
    """Tokenize ``text``; a token is learned when any of its characters lies in one of ``spans`` (a
    token that merges the space before a completion with its first word is what the model must
    emit, so it is learned whole rather than dropped)."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    labels = [
        token if any(begin < stop and start < end for start, stop in spans) else IGNORE_INDEX
        for token, (begin, end) in zip(ids, offsets, strict=True)
    ]
    return LabelledExample(tuple(ids), tuple(labels))
