"""``nemo-wrap finetune --objective dpo|simpo``: one process and two ranks train the same curve,
log TRL's metrics and the held-out ones, and save what transformers and PEFT load with the same
logits. The model is the embedded default with a ChatML template; the pairs are written here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.cli import main
from nemo_wrap.default_model import default_model_path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
METRICS = {"loss", "chosen_rewards", "rejected_rewards", "margins", "accuracy", "chosen_log_probs", "rejected_log_probs"}
EVALUATION = {"eval_loss", "eval_rewards_accuracy", "eval_rewards_margin", "eval_prefers_chosen"}


@pytest.fixture(scope="module")
def workspace(cache, tmp_path_factory):
    """The chat model and a training and a held-out file of pairs."""
    root = tmp_path_factory.mktemp("preference_job")
    model = root / "chat-model"
    shutil.copytree(default_model_path(), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(model)
    for name, count in (("pairs.jsonl", 16), ("held_out.jsonl", 4)):
        rows = [
            {
                "prompt": [{"role": "user", "content": f"Where does the rain fall {i}?"}],
                "chosen": [{"role": "assistant", "content": f"On the garden {i}."}],
                "rejected": [{"role": "assistant", "content": "The sun."}],
            }
            for i in range(count)
        ]
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _arguments(workspace: Path, objective: str, out: Path, *more: str) -> list[str]:
    return [
        "finetune", str(workspace / "chat-model"), "--objective", objective, "--data", str(workspace / "pairs.jsonl"),
        "--eval-data", str(workspace / "held_out.jsonl"), "--max-length", "96", "--steps", "3", "--eval-every", "3",
        "--lr", "2e-3", "--report-to", "none", "--output-dir", str(out), *more,
    ]  # fmt: skip


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def _two_ranks(arguments: list[str], cwd: Path) -> str:
    completed = subprocess.run(
        [sys.executable, "-m", "nemo_wrap.cli", *arguments, "--nproc", "2"],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


def test_a_dpo_job_on_two_ranks_equals_one_process_and_saves_a_model_transformers_loads(workspace, tmp_path, capsys):
    one = tmp_path / "one"
    assert main(_arguments(workspace, "dpo", one, "--batch-size", "4")) == 0
    said = capsys.readouterr().out
    assert "16 preference pairs (0 truncated, 0 dropped)" in said
    assert "dpo: reference = a frozen copy of the starting checkpoint" in said
    two = tmp_path / "two"
    said = _two_ranks(_arguments(workspace, "dpo", two, "--batch-size", "2"), tmp_path)
    expected, got = _records(one), _records(two)
    assert [set(record) >= METRICS for record in expected if "loss" in record] == [True] * 3
    assert set(expected[-1]) >= EVALUATION and expected[-1]["eval_rewards_accuracy"] == 1.0
    for mine, theirs in zip(got, expected, strict=True):
        for name in (METRICS | EVALUATION) & set(theirs):
            # a reward or margin is beta x a difference of log-probabilities: their absolute precision
            scale = 0.1 * max(abs(theirs.get("chosen_log_probs", 0)), abs(theirs.get("rejected_log_probs", 0)), 1)
            tolerance = 1e-5 * scale if "reward" in name or "margin" in name else 1e-6
            assert mine[name] == pytest.approx(theirs[name], rel=1e-5, abs=tolerance), name
    steps = [record for record in expected if "loss" in record]
    assert steps[2]["loss"] < steps[0]["loss"] == pytest.approx(0.693147, abs=1e-6)
    assert expected[0] == {"step": 0, **{name: pytest.approx(expected[0][name]) for name in EVALUATION}}
    assert expected[0]["eval_rewards_accuracy"] == 0.0  # before the first step every reward is 0
    trained = AutoModelForCausalLM.from_pretrained(two)
    ours = NeMoAutoModelForCausalLM.from_pretrained(one)
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        torch.testing.assert_close(trained(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-5)


def test_a_lora_simpo_job_on_two_ranks_saves_an_adapter_peft_loads_with_the_same_logits(workspace, tmp_path):
    out = tmp_path / "simpo"
    said = _two_ranks(_arguments(workspace, "simpo", out, "--batch-size", "2", "--lora-r", "4", "--beta", "2.0"), tmp_path)
    assert "simpo: reference = none: the objective is reference-free" in said
    records = _records(out)
    steps = [record for record in records if "loss" in record]
    assert steps[2]["loss"] < steps[0]["loss"] and records[-1]["eval_prefers_chosen"] == 1.0
    assert records[0]["step"] == 0 and records[0]["eval_prefers_chosen"] < 1.0
    base = workspace / "chat-model"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
    ours = NeMoAutoModelForCausalLM.from_pretrained(base, adapter=str(out)).eval()
    ids = torch.tensor([[1, 5, 9, 14, 20]])
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, ours(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("more", "said"),
    [(["--teacher", "x"], "with a distillation teacher: choose one objective"),
     (["--pack"], "data.pack applies to SFT data only (pairs are never packed)"),
     ([], "needs a preference data set (prompt, chosen, rejected) as data.train, not the bundled text corpus")],
)  # fmt: skip
def test_a_preference_job_without_pairs_or_with_a_teacher_is_refused(workspace, more, said, tmp_path, capsys):
    arguments = ["finetune", "--objective", "dpo", "--output-dir", str(tmp_path / "out"), *more]
    if more:
        arguments += ["--data", str(workspace / "pairs.jsonl")]
    with pytest.raises(SystemExit) as exited:
        main(arguments)
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_the_memory_prediction_counts_a_pair_as_two_rows():
    from dataclasses import replace

    from nemo_wrap.recipes.config import Recipe, TrainingSection
    from nemo_wrap.recipes.job import training_shape

    sft = Recipe(training=TrainingSection(batch_size=3))
    dpo = replace(sft, training=TrainingSection(batch_size=3, objective="dpo"))
    assert training_shape(dpo) == replace(training_shape(sft), batch_size=6)
