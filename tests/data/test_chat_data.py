"""Chat data: rows loaded and validated, labels only on assistant text and its end-of-turn token."""

from __future__ import annotations

import json

import pytest

from nemo_wrap.data import epoch_order, label_conversation, label_prompt_completion
from nemo_wrap.data.labels import IGNORE_INDEX
from nemo_wrap.data.rows import load_rows
from nemo_wrap.errors import ChatDataError, ChatTemplateError
from tests.support.chat_tokenizers import CHATML, CHATML_GENERATION, LLAMA3, NOT_PREFIX_CONSISTENT, chat_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "how are you today?"},
    {"role": "user", "content": "the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
TEMPLATES = [("chatml", CHATML, "<|im_end|>"), ("chatml", CHATML_GENERATION, "<|im_end|>"), ("llama3", LLAMA3, "<|eot_id|>")]


def _learned(tokenizer, example) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE_INDEX])


@pytest.mark.parametrize(("kind", "template", "end"), TEMPLATES, ids=["chatml", "chatml-generation-tag", "llama3"])
def test_only_assistant_text_and_its_end_of_turn_token_are_learned(kind, template, end):
    tokenizer = chat_tokenizer(kind, template)
    example = label_conversation(tokenizer, CONVERSATION)
    assert _learned(tokenizer, example) == f"how are you today?{end}Paris.{end}"
    last = label_conversation(tokenizer, CONVERSATION, last_turn_only=True)
    assert _learned(tokenizer, last) == f"Paris.{end}"
    assert last.input_ids == example.input_ids
    no_system = label_conversation(tokenizer, CONVERSATION[1:3])
    assert _learned(tokenizer, no_system) == f"how are you today?{end}"


def test_prompt_completion_learns_the_completion_and_eos():
    tokenizer = chat_tokenizer("chatml", CHATML)
    example = label_prompt_completion(tokenizer, "the capital of France?", " Paris.")
    assert _learned(tokenizer, example) == " Paris.<|im_end|>"
    merged = label_prompt_completion(tokenizer, "the capital of France? ", "Paris.")  # " Paris" is one token
    assert _learned(tokenizer, merged) == " Paris.<|im_end|>"


def test_a_template_that_is_not_prefix_consistent_is_refused():
    tokenizer = chat_tokenizer("chatml", NOT_PREFIX_CONSISTENT)
    with pytest.raises(ChatTemplateError, match="not prefix-consistent at message 2"):
        label_conversation(tokenizer, CONVERSATION)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_rows_are_loaded_in_each_format_and_bad_rows_named(tmp_path):
    chat = load_rows(_write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3))
    assert chat.format == "messages" and len(chat.rows) == 3
    pairs = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "q?", "answer": "a."}])
    mapped = load_rows(pairs, columns={"prompt": "question", "completion": "answer"})
    assert mapped.format == "prompt_completion" and mapped.rows == [{"prompt": "q?", "completion": "a."}]
    (tmp_path / "text.csv").write_text("text\nfirst line\nsecond line\n")
    assert load_rows(tmp_path / "text.csv").rows == [{"text": "first line"}, {"text": "second line"}]
    bad = [{"messages": CONVERSATION}, {"messages": [{"role": "robot", "content": "x"}]},
           {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}]
    path = _write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(ChatDataError, match=r"bad.jsonl: line 2: turn 0 has role 'robot'"):
        load_rows(path)
    skipped = load_rows(path, skip_bad_rows=True)
    assert len(skipped.rows) == 1 and sorted(skipped.skipped) == [1, 2] and "empty assistant" in skipped.skipped[2]
    with pytest.raises(ChatDataError, match="fit no format"):
        load_rows(_write_jsonl(tmp_path / "other.jsonl", [{"question": "q"}]))
    with pytest.raises(ChatDataError, match="cannot be loaded"):
        load_rows(tmp_path / "missing" / "org-name")


@pytest.mark.parametrize(("count", "ranks"), [(10, 2), (11, 2), (7, 4)])
def test_every_example_once_per_epoch_across_ranks(count, ranks):
    for epoch in range(3):
        dealt = [epoch_order(count, seed=5, epoch=epoch, dp_rank=r, dp_size=ranks) for r in range(ranks)]
        assert sorted(i for part in dealt for i in part) == list(range(count))
        assert dealt == [epoch_order(count, 5, epoch, r, ranks) for r in range(ranks)]  # deterministic
    assert epoch_order(count, 5, 0, 0, 1) != epoch_order(count, 5, 1, 0, 1)


def test_smollm2_template_labels(shared_cache):
    """SmolLM2-135M-Instruct's own ChatML template (it adds a system prompt when none is given)."""
    from transformers import AutoTokenizer

    from nemo_wrap.default_model import smollm2_instruct_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_instruct_path(shared_cache))
    for conversation in (CONVERSATION, CONVERSATION[1:]):
        example = label_conversation(tokenizer, conversation)
        assert _learned(tokenizer, example) == "how are you today?<|im_end|>Paris.<|im_end|>"
        assert "You are" in tokenizer.decode(example.input_ids)  # the system prompt is there, unlearned
