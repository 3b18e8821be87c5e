"""Every notebook in ``notebooks/`` runs top to bottom in a fresh kernel, then every cell once more.

The second pass, in the same kernel, is what a user does by re-running cells: it catches cells
that only work once (a process group initialized twice, an optimizer bound to stale parameters).
``lora_chat_sft`` runs once: its set-up cells are ``finetune_interactive``'s (initialize, load,
optimizer), and a second pass would add 30 s of SmolLM2 training that re-runs nothing new.
The kernel is this interpreter (the venv's python), whatever kernelspecs the machine has
installed: the spec manager looks in no directory and falls back to ipykernel's own native spec.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
# Guards against a hung cell, not a measure of speed: on a loaded 2-core machine the SmolLM2 cells of
# lora_chat_sft took more than 300 s. The whole test (two passes over every cell) gets its own guard.
CELL_TIMEOUT_S = 1200
NOTEBOOK_TIMEOUT_S = 3600
# What each notebook leaves behind (relative to its working directory).
OUTPUTS = {
    "finetune_interactive.ipynb": "nemo_wrap_output/notebook/config.json",
    "finetune_multirank.ipynb": "nemo_wrap_output/multirank/lora-tp/adapter_config.json",
    "lora_chat_sft.ipynb": "nemo_wrap_output/quack-adapter/adapter_config.json",
}


RUN_ONCE = {"lora_chat_sft"}


def test_there_is_a_notebook_to_run():
    assert [path.name for path in NOTEBOOKS] == sorted(OUTPUTS)


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs_top_to_bottom_and_again(path, tmp_path, monkeypatch, shared_cache):
    monkeypatch.setenv("NEMO_WRAP_CACHE", str(shared_cache))  # the kernel inherits it
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    kernel = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))
    assert kernel.kernel_spec.argv[0] == sys.executable
    client = NotebookClient(notebook, km=kernel, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(tmp_path)}})
    runs = ("first run",) if path.stem in RUN_ONCE else ("first run", "re-run")
    with client.setup_kernel():
        for run in runs:
            for index, cell in enumerate(notebook.cells):
                try:
                    client.execute_cell(cell, index)
                except CellExecutionError as error:
                    source = cell.source.splitlines()[0] if cell.source else ""
                    pytest.fail(f"{path.name}, cell {index} ({source!r}), {run}: {error.ename}: {error.evalue}\n{error}",
                                pytrace=False)
    assert (tmp_path / OUTPUTS[path.name]).is_file()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_the_stored_outputs_are_those_of_the_current_cells(path):
    """The docs show each notebook as stored: every code cell ran, the outputs were made from the
    cells as they are now (``scripts/execute_notebooks.py`` records a digest of their sources), and
    the plots are there as PNG images."""
    from scripts.execute_notebooks import sources_digest

    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "run scripts/execute_notebooks.py"
    assert notebook.metadata["nemo_wrap"]["sources_sha256"] == sources_digest(notebook), "outputs are stale"
    assert any("image/png" in output.get("data", {}) for cell in code for output in cell.outputs)
    assert not [output for cell in code for output in cell.outputs if output.output_type == "error"]
