"""The code stays readable by rule: no function in ``nemo_wrap/`` is longer than 50 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_wrap"
MAX_LINES = 50


def _function_lengths():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                yield f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}", node.end_lineno - first + 1


def test_the_walk_sees_the_package():
    lengths = dict(_function_lengths())
    assert len(lengths) > 200  # every module is parsed, not an empty glob
    assert any(name.endswith(" from_pretrained") for name in lengths)


def test_no_function_is_longer_than_50_lines():
    too_long = {name: lines for name, lines in _function_lengths() if lines > MAX_LINES}
    assert not too_long, f"split these functions into named steps: {too_long}"
