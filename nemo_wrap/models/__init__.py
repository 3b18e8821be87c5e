"""Architectures: one folder per architecture of our own, a spec for each, and the registry.

- :mod:`.spec`: ``ModelSpec``, everything nemo_wrap needs to know about one architecture.
- :mod:`.registry`: ``MODEL_ARCH_MAPPING`` (the list of specs), ``register_architecture`` and the
  resolution of a config to a spec and a class.
- :mod:`.llama`, :mod:`.qwen2`, :mod:`.qwen3`: our fused implementations (``model.py``) and their
  ``SPEC`` (``__init__.py``), on top of :mod:`.common`.
- :mod:`.conversion`: transformers' checkpoint conversion (renamed keys, merged experts) as windows.
- :mod:`.declared_plans`: the tensor-parallel plans transformers declares, as torch styles.

Our classes' names resolve lazily, so importing this package (or one architecture) does not
import the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "NeMoLlamaForCausalLM": "nemo_wrap.models.llama",
    "NeMoQwen2ForCausalLM": "nemo_wrap.models.qwen2",
    "NeMoQwen3ForCausalLM": "nemo_wrap.models.qwen3",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
