"""The embedded default: a small Llama checkpoint made on this machine, so that ``nemo-wrap`` runs
with no download and no arguments.

Only the recipe ships (a text corpus written for this project, a config, a seed); the checkpoint
is created deterministically on first use in a cache directory, see :mod:`.cache`. Beside it: a
real instruct model converted once from an offline package (:mod:`.smollm2`), and a small chat
set written for this project whose answers all open with "Quack!" — a behaviour a fine-tune can be
seen to learn (:func:`bundled_chat_set`), and a preference set that prefers that style with right
answers (:func:`bundled_preference_set`).
"""

from nemo_wrap.default_model.bundled import resolve_bundled
from nemo_wrap.default_model.cache import default_model_path
from nemo_wrap.default_model.recipe import bundled_chat_set, bundled_corpus, bundled_preference_set
from nemo_wrap.default_model.smollm2 import smollm2_instruct_path

__all__ = [
    "bundled_chat_set",
    "bundled_corpus",
    "bundled_preference_set",
    "default_model_path",
    "resolve_bundled",
    "smollm2_instruct_path",
]
