"""The documentation site builds without a warning, and its generated reference is complete.

The build is the one ``bash scripts/dev.sh docs`` runs (``-W -n``: a warning, a broken reference
or a missing object fails it), into a temporary folder. The reference is then read back as a user
sees it, in the HTML: every public name of ``nemo_wrap.__all__``, every flag of every command and
every recipe key must be there — the lists come from the code, not from the generator.
"""

from __future__ import annotations

import html
import re
import subprocess
from pathlib import Path

import pytest

import nemo_wrap
from nemo_wrap.cli import build_parser, command_parsers
from nemo_wrap.recipes.config_file import recipe_fields

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("site")
    built = subprocess.run(["bash", "scripts/dev.sh", "docs", str(output)], cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-5000:]
    warnings = [line for line in built.stderr.splitlines() if "WARNING:" in line and "bitsandbytes" not in line]
    assert warnings == []
    return output


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


def _command_flags() -> dict[str, set[str]]:
    return {
        name: {option for action in command._actions for option in action.option_strings} - {"-h", "--help"}
        for name, command in command_parsers(build_parser()).items()
    }


def test_every_public_name_has_its_entry_in_the_api_reference(site):
    page = (site / "reference" / "api.html").read_text()
    missing = [name for name in nemo_wrap.__all__ if f'id="nemo_wrap.{name}"' not in page]
    assert missing == []


def test_every_flag_of_every_command_is_in_the_cli_reference(site):
    text = _text(site / "reference" / "cli.html")
    sections = re.split(r"nemo-wrap (finetune|plan|report)¶", text)
    by_command = dict(zip(sections[1::2], sections[2::2]))
    for command, flags in _command_flags().items():
        missing = sorted(flag for flag in flags if not re.search(rf"{re.escape(flag)}\b(?![._-])", by_command[command]))
        assert missing == [], command


def test_every_recipe_key_is_in_the_recipe_reference(site):
    text = _text(site / "reference" / "recipe.html")
    assert [key for key in recipe_fields() if key not in text] == []


def test_every_environment_variable_the_code_reads_is_documented(site):
    read = set()
    for source in (ROOT / "nemo_wrap").rglob("*.py"):
        read |= set(re.findall(r"(?:environ|env)(?:\.get)?[\[(]\"([A-Z][A-Z0-9_]+)\"", source.read_text()))
    assert {"NEMO_WRAP_CACHE", "WORLD_SIZE"} <= read
    text = _text(site / "reference" / "environment.html")
    assert sorted(name for name in read if name not in text) == []


def test_the_notebook_pages_show_their_stored_plots(site):
    for name in ("finetune_interactive", "finetune_multirank", "lora_chat_sft"):
        page = (site / "tutorials" / f"{name}.html").read_text()
        assert re.search(r'<img [^>]*src="[^"]+\.png"', page), name


def test_the_site_has_search_and_highlighted_code(site):
    assert (site / "search.html").is_file() and (site / "searchindex.js").stat().st_size > 10_000
    assert '<div class="highlight-bash' in (site / "get-started" / "quickstart.html").read_text()
