"""Sphinx configuration of the nemo_wrap documentation site (``bash scripts/dev.sh docs``).

Sphinx rather than MkDocs: autodoc imports the package and renders the same docstrings mypy and
the tests read, intersphinx links to torch and transformers' own objects by name, ``-n`` turns a
reference to a missing object into a warning (and ``-W`` into a failed build), and MyST-NB renders
the notebooks with the outputs stored in them. Pages are Markdown (MyST), as the rest of the repo.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

import nemo_wrap  # noqa: E402  (the version shown is the package's own)

project = "nemo_wrap"
author = "the nemo_wrap developers"
copyright = "2026, the nemo_wrap developers"
release = nemo_wrap.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "nemo_wrap_reference",
]
exclude_patterns = ["_build", "reference/_generated"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# The notebooks are stored with their outputs (tests/notebooks checks they are): the site shows
# exactly what a run printed and plotted, and building it runs no model.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_typehints = "description"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
# -n checks every reference to our own public objects. Not checked: other libraries' names, and the
# types of the package's private modules that public signatures show (``nemo_wrap.loading.plan.Step``):
# they are named so a reader can find them in the source, not documented as API.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|transformers|peft|collections|typing|pathlib|argparse|enum)\..*"),
    (r"py:.*", r"nemo_wrap\.(?:[a-z_]+\.)+[A-Za-z_]+"),
]

html_theme = "furo"
html_title = f"nemo_wrap {release}"
html_static_path: list[str] = []
# "--nproc" stays two hyphens: the pages quote flags in running text.
smartquotes = False
