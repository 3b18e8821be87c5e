"""Run every notebook in ``notebooks/`` (or those named) top to bottom and store its outputs.

The documentation site shows the notebooks as they are stored, plots included, without running
them; this script is how the stored outputs are made. Each notebook runs in a fresh kernel of this
interpreter, in a temporary working directory (what it saves is thrown away), and is written back
with its outputs and a digest of its cells' sources in its metadata, by which
``tests/notebooks/test_notebooks.py`` tells outputs that no longer match the code. Run it after
editing a notebook:

    .venv/bin/python scripts/execute_notebooks.py [notebooks/NAME.ipynb ...]
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 1800
_WIDGET = "application/vnd.jupyter.widget-view+json"


def sources_digest(notebook: nbformat.NotebookNode) -> str:
    """SHA-256 of every code cell's source, in order: what the stored outputs were computed from."""
    sources = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    return hashlib.sha256("\0".join(sources).encode()).hexdigest()


def execute(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    kernel = KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    with tempfile.TemporaryDirectory() as workdir:
        client = NotebookClient(notebook, km=kernel, timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": workdir}})
        client.execute()
    store(notebook, path)


def store(notebook: nbformat.NotebookNode, path: Path) -> None:
    """Write ``notebook`` without what a static page cannot show: execution timestamps (noise in
    every diff) and live progress-bar widgets (their final text is printed by the cells anyway)."""
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if _WIDGET not in output.get("data", {})]
    notebook.metadata.pop("widgets", None)
    notebook.metadata["nemo_wrap"] = {"sources_sha256": sources_digest(notebook)}
    nbformat.write(notebook, path)


def main(paths: list[str]) -> None:
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend: figures stored as PNG
    for path in [Path(name) for name in paths] or sorted(NOTEBOOKS.glob("*.ipynb")):
        print(f"executing {path} ...", flush=True)
        execute(path)


if __name__ == "__main__":
    main(sys.argv[1:])
