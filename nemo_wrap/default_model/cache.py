"""Where the embedded default (and the converted SmolLM2) live, and how they get there exactly once.

Every rank of a job (and every test worker) may ask for the default at the same moment. One
process builds it under a file lock, into a hidden staging directory beside the final one, fsyncs
it and renames it into place (the checkpoint writer's own atomic swap): a directory that exists
under the final name is therefore complete, and readers that find it never take the lock. The
others wait on the lock and then find it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from nemo_wrap.checkpoint.atomic import discard, replace_directory, stage_directory
from nemo_wrap.default_model.recipe import write_default_model

# Bump the suffix whenever the recipe (corpus, tokenizer, config, seed) changes: the name is the
# cache key, and an old directory under the same name would otherwise be reused.
DEFAULT_MODEL_NAME = "default-llama-v1"


def cache_root() -> Path:
    """``$NEMO_WRAP_CACHE``, else ``$XDG_CACHE_HOME/nemo_wrap``, else ``~/.cache/nemo_wrap``."""
    explicit = os.environ.get("NEMO_WRAP_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nemo_wrap"


def default_model_path(root: str | Path | None = None) -> Path:
    """The default checkpoint's directory under ``root`` (default :func:`cache_root`), built on first use."""
    return cached_directory(DEFAULT_MODEL_NAME, write_default_model, root)


def cached_directory(name: str, write: Callable[[Path], None], root: str | Path | None = None) -> Path:
    """``root / name``, written by ``write`` (into a staging directory, swapped in) on first use."""
    root = cache_root() if root is None else Path(root)
    target = root / name
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if not target.is_dir():  # another process may have built it while we waited
            staged = stage_directory(target)
            try:
                write(staged)
                replace_directory(staged, target)
            finally:
                discard(staged)  # gone already after a successful swap
    return target
