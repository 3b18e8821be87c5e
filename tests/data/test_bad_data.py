"""A corpus of bad training data: each file is refused with a ``DataError`` naming it and its line.

One process reads each file as a job does (rows, then labels through the chat template); the last
test runs one bad file through ``nemo-wrap finetune`` on two gloo ranks, which both exit 2 with the
message, and neither waits for the other.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_wrap.data import load_rows, prepare_examples
from nemo_wrap.data.jsonl import MAX_LINE_BYTES
from nemo_wrap.errors import ChatTemplateError, DataError
from tests.support.chat_tokenizers import CHATML, chat_tokenizer

GOOD = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "how are you?"}]}
REFUSES_SYSTEM = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}{% endfor %}"
    + CHATML
)
WITH_SYSTEM = {"messages": [{"role": "system", "content": "be brief"}, *GOOD["messages"]]}


def _lines(*rows: object) -> bytes:
    return b"".join((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)


# name: (file suffix, contents, what the message must say, chat template or None for none)
CORPUS: dict[str, tuple[str, bytes, str, str | None]] = {
    "malformed_json": (".jsonl", _lines(GOOD, b'{"messages": [{"role": "user"'), "line 2: not JSON", CHATML),
    "truncated_last_line": (".jsonl", _lines(GOOD, GOOD)[:-9], "line 2: not JSON", CHATML),
    "array_line": (".jsonl", _lines(GOOD, [1, 2]), "line 2: a JSON list, not an object", CHATML),
    "string_line": (".jsonl", _lines(GOOD, GOOD, "hello"), "line 3: a JSON str, not an object", CHATML),
    "not_utf8": (".jsonl", _lines(GOOD, GOOD, b'{"text": "caf\xe9"}'), "line 3: not UTF-8", CHATML),
    "empty_file": (".jsonl", b"", "no rows (the file is empty or blank)", CHATML),
    "blank_file": (".jsonl", b"\n  \n\n", "no rows (the file is empty or blank)", CHATML),
    "missing_messages": (".jsonl", _lines(GOOD, {"conversation": []}), "line 2: messages must be a non-empty", CHATML),
    "messages_not_a_list": (".jsonl", _lines({"messages": "hi"}), "line 1: messages must be a non-empty", CHATML),
    "turn_without_content": (".jsonl", _lines(GOOD, {"messages": [{"role": "user"}]}), "line 2: turn 0 is not", CHATML),
    "unknown_role": (".jsonl", _lines(GOOD, b"", {"messages": [{"role": "robot", "content": "x"}]}),
                     "line 3: turn 0 has role 'robot'", CHATML),  # fmt: skip
    "empty_assistant_turn": (".jsonl", _lines({"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": " "}]}),
                             "line 1: turn 1 is an empty assistant turn", CHATML),  # fmt: skip
    "no_assistant_turn": (".jsonl", _lines(GOOD, GOOD, {"messages": [{"role": "user", "content": "a"}]}),
                          "line 3: no assistant turn", CHATML),  # fmt: skip
    "missing_text": (".jsonl", _lines({"text": "fine"}, {"txt": "typo"}), "line 2: text must be strings", CHATML),
    "completion_not_a_string": (".jsonl", _lines({"prompt": "p", "completion": 7}), "line 1: prompt, completion must",
                                CHATML),  # fmt: skip
    "empty_completion": (".jsonl", _lines({"prompt": "p", "completion": "x"}, {"prompt": "p", "completion": ""}),
                         "line 2: empty completion", CHATML),  # fmt: skip
    "no_known_columns": (".jsonl", _lines({"question": "q", "answer": "a"}), "fit no format", CHATML),
    "role_the_template_refuses": (".jsonl", _lines(GOOD, WITH_SYSTEM), "line 2: the chat template cannot render",
                                  REFUSES_SYSTEM),  # fmt: skip
    "tokenizer_without_template": (".jsonl", _lines(GOOD), "has no chat template; conversations need one",
                                   None),  # fmt: skip
    "unknown_file_type": (".yaml", b"messages: []\n", "unknown data file type", CHATML),
    "bad_csv_row": (".csv", b"prompt,completion\nq,a\nq2,\n", "row 1: prompt, completion must be strings", CHATML),
}


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_bad_file_is_refused_naming_the_file_and_the_line(name: str, tmp_path: Path) -> None:
    suffix, contents, said, template = CORPUS[name]
    path = tmp_path / f"{name}{suffix}"
    path.write_bytes(contents)
    tokenizer = chat_tokenizer("chatml", CHATML)
    tokenizer.chat_template = template
    with pytest.raises(DataError) as refused:
        prepare_examples(load_rows(path), tokenizer, max_length=64)
    assert str(refused.value).startswith(f"{path}: ") and said in str(refused.value), str(refused.value)
    if name in ("role_the_template_refuses", "tokenizer_without_template"):
        assert isinstance(refused.value, ChatTemplateError)


def test_a_ten_gigabyte_line_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A sparse file: 10 GiB of one line on no disk; the reader stops after MAX_LINE_BYTES."""
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as file:
        file.write(_lines(GOOD) + b'{"text": "')
        file.seek(10 * 2**30)
        file.write(b'"}\n')
    with pytest.raises(DataError, match=rf"huge.jsonl: line 2: longer than {MAX_LINE_BYTES:,} bytes; not read"):
        load_rows(path)


def test_bad_data_stops_every_rank_of_a_job_with_status_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(CORPUS["unknown_role"][1])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "nemo_wrap.cli", "finetune", "--data", str(path), "--steps", "2", "--report-to", "none",
               "--output-dir", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    said = f"nemo-wrap: error: {path}: line 3: turn 0 has role 'robot'"
    assert done.returncode != 0 and done.stderr.count(said) == 2, done.stderr[-3000:]
    assert "exitcode  : 2" in done.stderr  # torchrun's report of the ranks' status
