"""Complete training jobs built from the library's parts, and the recipe files the command line reads.

The job (:mod:`.sft`) needs transformers; it loads on first access, so reading or printing a recipe
(:mod:`.config`, :mod:`.config_file`) stays as cheap as ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SFTConfig", "run_sft"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("nemo_wrap.recipes.sft"), name)
    raise AttributeError(f"module 'nemo_wrap.recipes' has no attribute {name!r}")
