"""Preference pairs: TRL's three formats read alike, the prompt's tokens shared, labels only on the
completions, truncation and dropping as stated, and every bad row named by file and line."""

from __future__ import annotations

import json

import pytest

from nemo_wrap.data.preferences import (
    PreferenceFormat,
    load_preference_rows,
    pair_rows,
    prepare_pairs,
)
from nemo_wrap.errors import ChatTemplateError, DataError, PreferenceDataError
from nemo_wrap.training.preference import without_trailing_padding
from tests.support.chat_tokenizers import CHATML, chat_tokenizer

USER = [{"role": "user", "content": "hello there"}]
CHOSEN = [{"role": "assistant", "content": "how are you?"}]
REJECTED = [{"role": "assistant", "content": "Paris."}]
EXPLICIT = {"prompt": USER, "chosen": CHOSEN, "rejected": REJECTED}
IMPLICIT = {"chosen": USER + CHOSEN, "rejected": USER + REJECTED}
TEXT = {"prompt": "hello there, ", "chosen": "how are you?", "rejected": "Paris."}


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer("chatml", CHATML)


def _write(tmp_path, *rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _completion(example):
    return [token for token, label in zip(example.input_ids, example.labels, strict=True) if label != -100]


@pytest.mark.parametrize("row", [EXPLICIT, IMPLICIT], ids=["explicit-prompt", "implicit-prompt"])
def test_a_conversational_pair_shares_its_rendered_prompt_and_learns_each_completion_and_its_end(
    row, tokenizer, tmp_path
):
    rows = load_preference_rows(_write(tmp_path, row))
    assert rows.format is PreferenceFormat.CONVERSATIONAL
    (pair,) = prepare_pairs(rows, tokenizer, 64).pairs
    prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for example, answer in ((pair.chosen, CHOSEN), (pair.rejected, REJECTED)):
        assert list(example.input_ids[: len(prompt_ids)]) == prompt_ids
        assert set(example.labels[: len(prompt_ids)]) == {-100}
        assert tokenizer.decode(_completion(example)) == answer[0]["content"] + "<|im_end|>"


def test_a_text_pair_is_each_sequence_tokenized_whole_and_learns_each_completion_and_its_end(tokenizer, tmp_path):
    rows = load_preference_rows(_write(tmp_path, TEXT))
    assert rows.format is PreferenceFormat.TEXT
    (pair,) = prepare_pairs(rows, tokenizer, 64).pairs
    for example, completion in ((pair.chosen, "how are you?"), (pair.rejected, "Paris.")):
        whole = tokenizer("hello there, " + completion + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        assert list(example.input_ids) == whole  # the seam's tokens are the ones read after this prompt
        # the space that ends the prompt is the start of the completion's first token, as in TRL
        assert tokenizer.decode(_completion(example)) == " " + completion + tokenizer.eos_token
    prompt = [token for token, label in zip(pair.chosen.input_ids, pair.chosen.labels, strict=True) if label == -100]
    assert tokenizer.decode(prompt) == "hello there," and pair.rejected.input_ids[: len(prompt)] == tuple(prompt)


def test_a_long_completion_is_cut_at_max_length_and_a_prompt_that_fills_it_is_dropped(tokenizer, tmp_path):
    long_prompt = {**EXPLICIT, "prompt": [{"role": "user", "content": "hello there " * 40}]}
    rows = load_preference_rows(_write(tmp_path, EXPLICIT, long_prompt))
    full = prepare_pairs(rows, tokenizer, 512)
    assert len(full.pairs) == 2 and full.truncated == 0
    prompt_length = next(i for i, label in enumerate(full.pairs[0].chosen.labels) if label != -100)
    cut = prepare_pairs(rows, tokenizer, prompt_length + 2)
    assert (len(cut.pairs), cut.truncated, cut.dropped) == (1, 1, 1)
    assert cut.summary() == "1 preference pairs (1 truncated, 1 dropped)"
    assert len(cut.pairs[0].chosen) == prompt_length + 2 and len(_completion(cut.pairs[0].chosen)) == 2
    with pytest.raises(PreferenceDataError, match=r"pairs.jsonl: no pair has room for a completion \(max_length=4\)"):
        prepare_pairs(rows, tokenizer, 4)


def test_pair_rows_put_chosen_then_rejected_and_a_cut_keeps_every_label(tokenizer, tmp_path):
    rows = load_preference_rows(_write(tmp_path, EXPLICIT, EXPLICIT))
    pairs = prepare_pairs(rows, tokenizer, 64).pairs
    row = pair_rows(pairs, 64, tokenizer.pad_token_id)[0]
    assert row["input_ids"].shape == row["labels"].shape == row["position_ids"].shape == (2, 64)
    assert row["input_ids"][0, : len(pairs[0].chosen)].tolist() == list(pairs[0].chosen.input_ids)
    assert row["input_ids"][1, : len(pairs[0].rejected)].tolist() == list(pairs[0].rejected.input_ids)
    cut = without_trailing_padding(row)
    longest = max(len(pairs[0].chosen), len(pairs[0].rejected))
    assert cut["input_ids"].shape == (2, longest)
    assert int((cut["labels"] != -100).sum()) == int((row["labels"] != -100).sum())


BAD = {
    "no_rejected": ({"prompt": "a", "chosen": "b"}, "line 2: no rejected"),
    "two_turn_completion": ({**EXPLICIT, "chosen": CHOSEN + CHOSEN}, "line 2: chosen must be one assistant turn"),
    "user_completion": ({**EXPLICIT, "rejected": USER}, "line 2: rejected must be one assistant turn"),
    "mixed_types": ({**EXPLICIT, "chosen": "text"}, "line 2: prompt, chosen and rejected must be all strings or all lists"),
    "bad_role": ({**EXPLICIT, "prompt": [{"role": "robot", "content": "x"}]}, "line 2: prompt: turn 0 has role 'robot'"),
    "empty_text": ({**TEXT, "rejected": "  "}, "line 2: empty rejected"),
    "empty_text_prompt": ({**TEXT, "prompt": ""}, "line 2: empty prompt"),
    "implicit_differs_early": ({"chosen": USER + CHOSEN, "rejected": [{"role": "user", "content": "other"}] + REJECTED},
                               "line 2: without a prompt column, chosen and rejected must be conversations that share"),
    "implicit_ends_with_user": ({"chosen": CHOSEN + USER, "rejected": CHOSEN + USER},
                                "line 2: the last turn of chosen and rejected must be the assistant's"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_row_is_refused_naming_the_file_and_line(name, tmp_path):
    row, said = BAD[name]
    first = TEXT if "text" in name else (IMPLICIT if "implicit" in name else EXPLICIT)
    path = _write(tmp_path, first, row)
    with pytest.raises(DataError) as refused:
        load_preference_rows(path)
    assert str(refused.value).startswith(f"{path}: ") and said in str(refused.value)


def test_formats_mixed_in_one_file_are_refused(tmp_path):
    with pytest.raises(PreferenceDataError, match="rows mix conversational and plain-text pairs"):
        load_preference_rows(_write(tmp_path, EXPLICIT, TEXT))


def test_a_template_whose_prompt_is_not_a_prefix_is_refused_naming_the_line(tmp_path):
    shifting = "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    rows = load_preference_rows(_write(tmp_path, EXPLICIT, EXPLICIT))
    with pytest.raises(ChatTemplateError, match=r"pairs.jsonl: line 1: the chat template is not prefix-consistent"):
        prepare_pairs(rows, chat_tokenizer("chatml", shifting), 64)


def test_a_file_without_chosen_and_rejected_columns_is_refused_naming_them(tmp_path):
    path = _write(tmp_path, {"prompt": "a", "completion": "b"})
    with pytest.raises(PreferenceDataError, match=r"columns \['completion', 'prompt'\]: a preference set needs chosen and"):
        load_preference_rows(path)


def test_other_column_names_are_mapped_onto_prompt_chosen_and_rejected(tokenizer, tmp_path):
    renamed = {"question": USER, "better": CHOSEN, "worse": REJECTED}
    rows = load_preference_rows(_write(tmp_path, renamed), {"prompt": "question", "chosen": "better", "rejected": "worse"})
    assert rows.pairs[0].prompt == USER and rows.pairs[0].chosen == CHOSEN and rows.pairs[0].rejected == REJECTED
    with pytest.raises(PreferenceDataError, match=r"map yours with columns="):
        load_preference_rows(_write(tmp_path, renamed, name="unmapped.jsonl"))
