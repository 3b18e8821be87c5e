"""Our causal LMs with fused projections: ``NeMoLlamaForCausalLM``, ``NeMoQwen2ForCausalLM``,
``NeMoQwen3ForCausalLM``.

Each architecture lives in its own subpackage (``model``, ``state_dict_adapter``, ``parallelize``)
on top of :mod:`nemo_wrap.models.common`. The class names resolve lazily, so importing this package
(or one architecture) does not import the others.
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
