"""Names for what ships with nemo_wrap, so a recipe file can point at it on any machine.

A recipe that says ``model: bundled:smollm2-135m-instruct`` or ``data: {train:
bundled:quack-chat-train}`` runs wherever nemo_wrap is installed; an absolute path into a cache
directory would not. The names are resolved when the job starts and stay names in the written
``config.yaml``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nemo_wrap.default_model.cache import default_model_path
from nemo_wrap.default_model.recipe import bundled_chat_set, bundled_corpus, bundled_preference_set
from nemo_wrap.default_model.smollm2 import smollm2_instruct_path
from nemo_wrap.errors import CheckpointNotFoundError

PREFIX = "bundled:"
_BUNDLED: dict[str, Callable[[], Path]] = {
    "default": default_model_path,
    "smollm2-135m-instruct": smollm2_instruct_path,
    "corpus": bundled_corpus,
    "quack-chat-train": lambda: bundled_chat_set("train"),
    "quack-chat-eval": lambda: bundled_chat_set("eval"),
    "quack-preferences-train": lambda: bundled_preference_set("train"),
    "quack-preferences-eval": lambda: bundled_preference_set("eval"),
}


def resolve_bundled(location: str) -> str:
    """``location`` itself, or for ``bundled:NAME`` the path of that bundled model or data set
    (a model is built on first use)."""
    if not location.startswith(PREFIX):
        return location
    name = location.removeprefix(PREFIX)
    if name not in _BUNDLED:
        raise CheckpointNotFoundError(f"{location}: no such bundled model or data set; known: {', '.join(_BUNDLED)}")
    return str(_BUNDLED[name]())
