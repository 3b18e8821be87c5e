"""The embedded default: a small Llama checkpoint made on this machine, so that ``nemo-wrap`` runs
with no download and no arguments.

Only the recipe ships (a text corpus written for this project, a config, a seed); the checkpoint
is created deterministically on first use in a cache directory, see :mod:`.cache`.
"""

from nemo_wrap.default_model.cache import default_model_path
from nemo_wrap.default_model.recipe import bundled_corpus

__all__ = ["bundled_corpus", "default_model_path"]
