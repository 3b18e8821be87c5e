"""Recipe files: the schema, the YAML reader with its errors, flag overrides, and runs they reproduce.

The runs are real ``nemo-wrap finetune`` jobs in this process (one rank); the reproduction check
compares every logged loss of a run with the run of its own written ``config.yaml``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from nemo_wrap.cli import main
from nemo_wrap.default_model import bundled_preference_set
from nemo_wrap.errors import RecipeError
from nemo_wrap.recipes.config import Recipe
from nemo_wrap.recipes.config_file import Setting, build_recipe, read_recipe_file, recipe_fields, recipe_to_yaml

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _resolved(capsys, tmp_path: Path, argv: list[str]) -> Recipe:
    assert main([*argv, "--print-config"]) == 0
    printed = _write(tmp_path / "printed.yaml", capsys.readouterr().out)
    return build_recipe(read_recipe_file(printed))


def _losses(log_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.parametrize("recipe", SHIPPED, ids=[path.stem for path in SHIPPED])
def test_every_shipped_recipe_resolves_and_prints_back_to_itself(recipe, tmp_path, capsys):
    resolved = _resolved(capsys, tmp_path, ["finetune", "--config", str(recipe)])
    assert resolved == build_recipe(read_recipe_file(recipe))
    assert resolved != Recipe()  # the file set something


def test_defaults_file_then_flags_and_dotted_overrides(tmp_path, capsys):
    recipe = _write(tmp_path / "r.yaml", "distributed:\n  tp_size: 2\n  cp_size: 2\noptimizer:\n  lr: 1e-4\n")
    resolved = _resolved(
        capsys,
        tmp_path,
        [
            "finetune",
            "--config",
            str(recipe),
            "--tp-size",
            "4",
            "--optimizer.warmup_steps",
            "3",
            "--pack",
            "--data.columns",
            "a=b",
        ],
    )
    assert resolved.distributed.tp_size == 4 and resolved.distributed.cp_size == 2  # flag over file, file kept
    assert resolved.optimizer.lr == 1e-4 and resolved.optimizer.warmup_steps == 3  # 1e-4: YAML 1.1 reads a str
    assert resolved.data.pack is True and resolved.data.columns == {"a": "b"}
    assert resolved.training == Recipe().training  # untouched sections keep the schema's defaults


def test_qlora_shorthand_fills_only_what_is_not_set(tmp_path, capsys):
    assert _resolved(capsys, tmp_path, ["finetune", "--qlora"]).lora.r == 16
    recipe = _write(tmp_path / "r.yaml", "lora:\n  r: 4\n")
    resolved = _resolved(capsys, tmp_path, ["finetune", "--qlora", "--config", str(recipe)])
    assert (resolved.lora.r, resolved.load.quantization) == (4, "nf4")


BAD_FILES = {
    "unknown-key": (
        "training:\n  steps: 3\n  stpes: 4\n",
        "r.yaml:3: training.stpes: unknown key (did you mean training.steps?)",
    ),
    "unknown-section": ("trainer:\n  steps: 3\n", "r.yaml:1: trainer: unknown key"),
    "wrong-type": ("distributed:\n  tp_size: two\n", "r.yaml:2: distributed.tp_size: expected an integer, got 'two'"),
    "bool-for-int": ("training:\n  steps: true\n", "r.yaml:2: training.steps: expected an integer"),
    "bad-value": ("optimizer:\n  lr: -1.0\n", "r.yaml:2: optimizer.lr: must be positive, got -1.0"),
    "bad-choice": (
        "optimizer:\n  lr_schedule: linear\n",
        "r.yaml:2: optimizer.lr_schedule: must be one of cosine, constant",
    ),
    "bad-tracker": (
        "logging:\n  report_to: [tensorboard, comet]\n",
        "r.yaml:2: logging.report_to: unknown tracker 'comet'",
    ),
    "twice": ("training:\n  steps: 3\n  steps: 4\n", "r.yaml:3: training.steps: set twice"),
    "section-scalar": ("training: 3\n", "r.yaml:1: training: expected a mapping"),
    "not-yaml": ("training: [\n", "r.yaml: not valid YAML"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_recipe_exits_2_naming_the_key_and_line(name, tmp_path, capsys):
    text, expected = BAD_FILES[name]
    recipe = _write(tmp_path / "r.yaml", text)
    with pytest.raises(SystemExit) as excinfo:
        main(["finetune", "--config", str(recipe), "--print-config"])
    assert excinfo.value.code == 2
    assert expected in capsys.readouterr().err


def test_a_bad_flag_value_names_the_flag_and_key(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["finetune", "--tp-size", "0", "--print-config"])
    assert excinfo.value.code == 2
    assert "--tp-size: distributed.tp_size: must be positive, got '0'" in capsys.readouterr().err


def test_a_section_built_in_python_runs_the_same_checks():
    """``SFTConfig`` takes the sections themselves: a library user gets the recipe's check, once, at construction."""
    from nemo_wrap.errors import InvalidSetupError
    from nemo_wrap.recipes.config import DataSection, OptimizerSection, TrainingSection

    with pytest.raises(InvalidSetupError, match=r"OptimizerSection\.lr_schedule: must be one of cosine, constant"):
        OptimizerSection(lr_schedule="linear")
    with pytest.raises(InvalidSetupError, match=r"TrainingSection\.batch_size: must be positive, got 0"):
        TrainingSection(batch_size=0)
    assert DataSection(eval=None).eval is None  # None is "not set", never checked


def test_a_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(RecipeError, match=r"nowhere\.yaml: cannot read the recipe"):
        read_recipe_file(tmp_path / "nowhere.yaml")


def test_every_key_has_help_and_round_trips_through_yaml():
    fields = recipe_fields()
    assert all(spec.help for spec in fields.values())
    changed = build_recipe([Setting("logging.report_to", "none", "test"), Setting("training.steps", 7, "test")])
    assert changed.logging.report_to == () and changed.training.steps == 7
    assert (
        build_recipe(Setting(key, value, "y") for key, value in _flat(yaml.safe_load(recipe_to_yaml(changed))))
        == changed
    )


def _flat(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in recipe_fields():
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_a_recipe_with_two_overrides_runs_and_its_config_yaml_reproduces_it(cache, tmp_path):
    output = tmp_path / "run"
    assert main(["--config", str(REPO / "recipes" / "default.yaml"), "--steps", "4",
                 "--output-dir", str(output)]) == 0  # fmt: skip
    written = output / "config.yaml"
    assert build_recipe(read_recipe_file(written)).training.steps == 4
    first = _losses(output / "logs")
    again = tmp_path / "again"
    assert main(["--config", str(written), "--output-dir", str(again)]) == 0
    assert len(first) == 4 and _losses(again / "logs") == first


def test_the_smollm2_chat_recipe_runs_with_two_overrides(shared_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEMO_WRAP_CACHE", str(shared_cache))
    output = tmp_path / "chat"
    argv = [
        "finetune",
        "--config",
        str(REPO / "recipes/smollm2_lora_chat.yaml"),
        "--steps",
        "2",
        "--data.max_length",
        "128",
        "--output-dir",
        str(output),
        "--checkpoint.save_every",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(messages)" in out and "(2 steps)" in out
    assert (output / "adapter_config.json").is_file() and len(_losses(output / "logs")) == 2
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_the_smollm2_dpo_recipe_runs_with_its_held_out_pairs_cut_short(shared_cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NEMO_WRAP_CACHE", str(shared_cache))
    held_out = tmp_path / "held_out.jsonl"  # 4 of the 40 held-out pairs: the evaluation before and after
    held_out.write_text("".join(bundled_preference_set("eval").read_text().splitlines(keepends=True)[:4]))
    output = tmp_path / "dpo"
    argv = ["finetune", "--config", str(REPO / "recipes/smollm2_lora_dpo.yaml"), "--steps", "2",
            "--eval-data", str(held_out), "--output-dir", str(output)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "276 preference pairs (0 truncated, 0 dropped)" in out and "(2 steps)" in out
    assert "dpo: reference = the model itself with its LoRA adapters switched off" in out
    records = [json.loads(line) for line in (output / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [0, 1, 2, 2]  # evaluated before the first step and after the last
    assert records[1]["loss"] == pytest.approx(0.693147, abs=1e-6) and records[2]["loss"] < records[1]["loss"]
    assert (output / "adapter_config.json").is_file()


KILLED_MID_SAVE = """
import sys, time
from nemo_wrap.checkpoint import resume

real_save, calls = resume.dcp.save, []

def save_then_stall(state, **kwargs):  # the second save: files staged, never moved in
    calls.append(kwargs)
    real_save(state, **kwargs)
    if len(calls) == 2:
        print("STALLED", flush=True)
        time.sleep(600)

resume.dcp.save = save_then_stall
from nemo_wrap.cli import main
from nemo_wrap.default_model import bundled_preference_set
sys.exit(main(sys.argv[1:]))
"""


def _step_losses(log_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}  # a resumed run's steps overwrite


def test_a_run_killed_during_a_save_resumes_from_the_newest_complete_checkpoint(cache, tmp_path, capsys):
    import signal
    import subprocess
    import sys

    job = ["--steps", "6", "--save-every", "2", "--keep-last", "2", "--report-to", "none", "--batch-size", "4"]
    assert main([*job, "--output-dir", str(tmp_path / "whole")]) == 0
    whole = _step_losses(tmp_path / "whole" / "logs")
    assert sorted(p.name for p in (tmp_path / "whole").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert (tmp_path / "whole" / "latest").read_text().strip() == "checkpoint-6"

    output = tmp_path / "killed"
    script = tmp_path / "killed_mid_save.py"
    script.write_text(KILLED_MID_SAVE)
    child = subprocess.Popen([sys.executable, str(script), *job, "--output-dir", str(output)],
                             stdout=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    try:
        assert any(line.startswith("STALLED") for line in child.stdout), "the child never reached its second save"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-2"]  # step 4 staged, never moved in
    (staged,) = output.glob(".checkpoint-4.tmp-*")
    assert main([*job, "--output-dir", str(output), "--resume", "auto"]) == 0
    assert f"leftovers of a killed save: removed {staged}: the staging of a save that was killed" in capsys.readouterr().out
    assert not list(output.glob(".checkpoint-*"))
    resumed = _step_losses(output / "logs")
    assert resumed.keys() == whole.keys()
    for step in range(3, 7):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-6), step
