"""The README is a landing page, and every command it shows is run.

Each line of the README's ``bash`` blocks is found here, and each is run as written, in a fresh
directory, by the test named for it — with ``--steps 2`` (and a temporary ``--output-dir``) added
to the jobs that train, so CI stays short. A hub id is read offline from a private Hugging Face cache
where SmolLM2-135M-Instruct (converted from the registry's GGUF file) is planted under its hub id.
Some lines are run elsewhere, and this module checks they are the same lines there:
``bash scripts/dev.sh test`` is CI itself (``.ci/run``), ``git clone`` is what CI does first, the
multi-node ``torchrun`` line is the SLURM script's, which ``tests/cross_cutting/test_two_nodes.py``
runs, and two jobs are run by the CLI's and the recipes' tests with overrides (their words are
checked to be in those tests).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_wrap.default_model.smollm2 import smollm2_instruct_path
from tests.support.hub_cache import plant_in_hub_cache
from tests.support.launch_lines import torchrun_words

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHORT = ["--steps", "2"]


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.S | re.M)


def _commands() -> list[str]:
    """Every command line of the README's bash blocks, without its trailing comment."""
    lines = [line for block in _blocks("bash") for line in block.replace("\\\n", " ").splitlines()]
    return [re.sub(r"\s+#\s.*$", "", line).strip() for line in lines if line.strip()]


# Each README command, and how it is run: "run" (here, as written), "run, shortened" (here, with
# --steps 2 and a temporary --output-dir), "run, dry" (pip's --dry-run), or where else it runs: a
# test that runs the same command with overrides, CI itself, or the two-node test.
HOW = {
    "bash scripts/dev.sh run": "run, shortened",
    "bash scripts/dev.sh test": "CI: .ci/run",
    "git clone <this repository> nemo_wrap && cd nemo_wrap": "CI: a clean clone",
    'pip install -e ".[qlora,wandb]"': "run, dry",
    "nemo-wrap": "test: tests/recipes/test_cli.py::test_no_command_means_finetune_on_the_default",
    f"nemo-wrap finetune {HUB_ID} --data chat.jsonl --lora-r 16 --output-dir smollm2-lora": "run",
    "nemo-wrap finetune --config recipes/smollm2_lora_chat.yaml": (
        "test: tests/recipes/test_recipes.py::test_the_smollm2_chat_recipe_runs_with_two_overrides"
    ),
    "nemo-wrap finetune --config recipes/smollm2_lora_dpo.yaml": (
        "test: tests/recipes/test_recipes.py::test_the_smollm2_dpo_recipe_runs_with_its_held_out_pairs_cut_short"
    ),
    f"nemo-wrap plan {HUB_ID} --nproc 8": "run",
    f"nemo-wrap report {HUB_ID}": "run",
    "torchrun --standalone --nproc-per-node 2 -m nemo_wrap.cli finetune --strategy fsdp2 --tp-size 2": "run, shortened",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 --rdzv-id job1 "
    "--max-restarts 2 -m nemo_wrap.cli finetune --config recipes/hsdp.yaml --save-every 10 --resume auto": "two nodes",
}
RUN_HERE = [command for command, how in HOW.items() if how.startswith("run")]


def test_the_readme_is_a_short_landing_page_with_install_near_the_top():
    text = README.read_text()
    assert len(text.encode()) <= 15_000
    assert "## Install" in text.splitlines()[:40]
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        assert (ROOT / target).exists(), target


def test_every_command_of_the_readme_is_known_here():
    assert _commands() == list(HOW)


def test_the_example_in_each_command_s_help_is_a_readme_command(capsys):
    from nemo_wrap.cli import main

    for command in ("finetune", "plan", "report"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        example = capsys.readouterr().out.split("example:\n", 1)[1].strip()
        assert HOW.get(example, "").startswith("run"), example


def test_the_commands_run_elsewhere_are_the_same_lines_there():
    for command, how in HOW.items():
        if how.startswith("test: "):
            module, name = how.removeprefix("test: ").split("::")
            source = (ROOT / module).read_text()
            body = source[source.index(f"def {name}(") :].split("\ndef ", 1)[0]
            assert all(word.removeprefix("nemo-wrap") in body for word in command.split()[1:]), command
    assert "bash scripts/dev.sh test" in (ROOT / ".ci" / "run").read_text()
    launch = torchrun_words((ROOT / "docs" / "how-to" / "launch" / "multinode.sbatch").read_text())
    shown = shlex.split(next(command for command, how in HOW.items() if how == "two nodes"))
    assert shown[1 : shown.index("-m") : 2] == launch[1 : launch.index("-m") : 2]  # the same options, in order
    assert shown[shown.index("-m") :] == launch[launch.index("-m") :]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, shared_cache):
    """A user's directory: the README's example row as ``chat.jsonl``, the shipped recipes, and a
    Hugging Face cache that holds SmolLM2 under its hub id."""
    directory = tmp_path_factory.mktemp("readme")
    row = json.loads(_blocks("json")[0])
    (directory / "chat.jsonl").write_text(json.dumps(row) + "\n")
    (directory / "recipes").symlink_to(ROOT / "recipes")
    plant_in_hub_cache(smollm2_instruct_path(shared_cache), directory / "hf", HUB_ID)
    return directory


def _environment(workdir: Path, shared_cache: Path) -> dict[str, str]:
    bin_directory = str(Path(sys.executable).parent)  # nemo-wrap and torchrun of this venv
    return {
        **os.environ,
        "PATH": os.pathsep.join([bin_directory, os.environ["PATH"]]),
        "HF_HOME": str(workdir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "NEMO_WRAP_CACHE": str(shared_cache),
        "NEMO_WRAP_PROGRESS": "0",
    }


def _as_run(command: str, how: str, output: Path) -> str:
    if how == "run, shortened":
        return f"{command} {' '.join(SHORT)} --output-dir {output}"
    if how == "run, dry":
        return command.replace("pip install", f"{sys.executable} -m pip install --dry-run --quiet", 1)
    return command


@pytest.mark.parametrize("command", RUN_HERE, ids=[f"{index}" for index in range(len(RUN_HERE))])
def test_the_readme_command_runs(command, workdir, shared_cache, tmp_path):
    how = HOW[command]
    ran = subprocess.run(
        _as_run(command, how, tmp_path / "out"),
        shell=True,
        cwd=ROOT if command.startswith(("pip", "bash scripts/")) else workdir,  # where the README runs them
        env=_environment(workdir, shared_cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    if how == "run, shortened":
        assert "loss: first step" in ran.stdout and "(2 steps)" in ran.stdout
    if "--lora-r 16" in command:
        assert (workdir / "smollm2-lora" / "adapter_model.safetensors").is_file()


def test_the_python_example_runs_and_the_docs_show_the_same(tmp_path, cache):
    (example,) = _blocks("python")
    page = (ROOT / "docs" / "get-started" / "python-api.md").read_text()
    assert f"```python\n{example}```" in page
    ran = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert re.search(r"^loss \d+\.\d{4}$", ran.stdout, re.M)
    assert (tmp_path / "my-model" / "model.safetensors").is_file()
