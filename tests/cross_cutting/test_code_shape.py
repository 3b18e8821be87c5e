"""The code stays readable by rule, checked on every run of the test command:

- no function in ``nemo_wrap/`` is longer than 50 lines;
- no internal function takes more than 8 parameters (the public API's keyword lists are listed);
- no ``setup is None`` branch: one process is ``DistributedSetup.single_process()``, and the public
  keyword's ``None`` becomes it in one place (``DistributedSetup.given``);
- no strategy name compared as a string outside the strategy registry (ask the entry instead);
- no ``# fmt: skip`` / ``# fmt: off`` region packing code under the limits;
- no import from a higher layer, type-only imports included (import-linter, configured here).

Each rule is a function of one module's source, so each is also shown to catch a planted violation.
"""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

import pytest

from nemo_wrap.distributed.strategies import strategy_names
from nemo_wrap.distributed.strategies.registry import SINGLE_PROCESS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nemo_wrap"
MAX_LINES = 50
MAX_PARAMETERS = 8
# Public signatures that mirror transformers' or are the documented API: their keywords are the
# product (each one documented), not an internal function's grab bag.
PUBLIC_SIGNATURES = {
    "auto/auto_model.py plan",  # NeMoAutoModelForCausalLM.plan: from_pretrained's keywords, dry-run
    "auto/auto_model.py from_pretrained",  # transformers' from_pretrained keywords
    "auto/model_mixin.py save_pretrained",  # transformers' save_pretrained keywords
    "distributed/setup.py build",  # DistributedSetup.build: one keyword per parallel degree
    "models/common/causal_lm.py forward",  # transformers' CausalLM forward signature
    "models/common/decoder.py forward",  # transformers' decoder forward signature
}
# The one place the public keyword's None becomes the single-process setup.
NONE_TO_SETUP = "distributed/setup.py given"
REGISTRY_DIR = "distributed/strategies/"
STRATEGY_NAMES = {*strategy_names(), SINGLE_PROCESS.name}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def long_functions(relative: str, source: str) -> list[str]:
    found = []
    for node in _functions(ast.parse(source)):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        if node.end_lineno - first + 1 > MAX_LINES:
            found.append(f"{relative}:{node.lineno} {node.name} ({node.end_lineno - first + 1} lines)")
    return found


def many_parameters(relative: str, source: str) -> list[str]:
    found = []
    for node in _functions(ast.parse(source)):
        arguments = node.args
        names = [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]
        count = len(names) - (1 if names and names[0] in ("self", "cls") else 0)
        if count > MAX_PARAMETERS and f"{relative} {node.name}" not in PUBLIC_SIGNATURES:
            found.append(f"{relative}:{node.lineno} {node.name} ({count} parameters)")
    return found


def _names_a_setup(node: ast.expr) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.lower().endswith("setup")


def setup_none_branches(relative: str, source: str) -> list[str]:
    found = []
    for function in _functions(ast.parse(source)):
        if f"{relative} {function.name}" == NONE_TO_SETUP:
            continue
        for node in ast.walk(function):
            if not isinstance(node, ast.Compare) or not isinstance(node.ops[0], (ast.Is, ast.IsNot)):
                continue
            sides = [node.left, *node.comparators]
            if any(_names_a_setup(side) for side in sides) and any(
                isinstance(side, ast.Constant) and side.value is None for side in sides
            ):
                found.append(f"{relative}:{node.lineno} {function.name}")
    return sorted(set(found))


def strategy_name_comparisons(relative: str, source: str) -> list[str]:
    if relative.startswith(REGISTRY_DIR):
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        constants = [
            element
            for side in (node.left, *node.comparators)
            for element in (side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side])
        ]
        if any(isinstance(c, ast.Constant) and c.value in STRATEGY_NAMES for c in constants):
            found.append(f"{relative}:{node.lineno}")
    return found


def formatter_escapes(relative: str, source: str) -> list[str]:
    return [
        f"{relative}:{number}"
        for number, line in enumerate(source.splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]


RULES = [long_functions, many_parameters, setup_none_branches, strategy_name_comparisons, formatter_escapes]


def test_the_walk_sees_the_package():
    modules = dict(_modules())
    assert len(modules) > 100  # every module is read, not an empty glob
    assert any(name.endswith("from_pretrained") for name in PUBLIC_SIGNATURES)
    lengths = [f.name for _, source in modules.items() for f in _functions(ast.parse(source))]
    assert len(lengths) > 200 and "resolve_load_plan" in lengths


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_package_keeps_the_rule(rule):
    found = [violation for relative, source in _modules() for violation in rule(relative, source)]
    assert not found, f"{rule.__name__}: {found}"


PLANTED = {
    long_functions: "def f():\n" + "    x = 1\n" * 50,
    many_parameters: "def f(a, b, c, d, e, f, g, h, i):\n    return a\n",
    setup_none_branches: "def f(setup):\n    return 1 if setup is None else setup.dp_size\n",
    strategy_name_comparisons: "def f(setup):\n    return setup.strategy in ('ddp', 'x')\n",
    formatter_escapes: "x = [1,\n  2]  # fmt: skip\n",
}


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_each_rule_catches_a_planted_violation(rule):
    assert rule("training/planted.py", PLANTED[rule]), f"{rule.__name__} missed its planted violation"


def test_the_exemptions_are_where_they_say():
    assert many_parameters("auto/auto_model.py", PLANTED[many_parameters].replace("def f", "def from_pretrained")) == []
    planted = "def given(setup):\n    return 1 if setup is None else setup\n"
    assert setup_none_branches("distributed/setup.py", planted) == []
    assert setup_none_branches("distributed/other.py", planted)
    assert strategy_name_comparisons("distributed/strategies/ddp.py", PLANTED[strategy_name_comparisons]) == []


def test_type_only_imports_count_in_the_layer_contract():
    """``lint-imports`` (run by the test command before pytest) also checks ``if TYPE_CHECKING:`` imports."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["importlinter"]["exclude_type_checking_imports"].strip() == "False"
    assert "lint-imports" in (ROOT / "scripts" / "dev.sh").read_text()
