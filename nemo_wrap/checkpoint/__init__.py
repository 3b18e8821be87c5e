"""Checkpoints: reading transformers checkpoints, writing them consolidated, resumable sharded state.

- :mod:`.locate`, :mod:`.safetensors_file`: locating, validating and reading checkpoint files.
- :mod:`.save`: one consolidated transformers checkpoint from any strategy (``save_pretrained``).
- :mod:`.resume`: :func:`save_checkpoint` / :func:`load_checkpoint`, sharded model + optimizer state,
  resumable on another topology; :mod:`.manifest` and :mod:`.compatibility`: what a load checks
  first (the files are the save's; the checkpoint fits the model and optimizer).
- :mod:`.atomic`: directories swapped in whole, so a killed save never leaves half a checkpoint.
- :mod:`.rotation`: :class:`CheckpointRotation` (``checkpoint-{step}`` folders, a ``latest`` pointer,
  ``keep_last`` pruning, background saves), :func:`newest_checkpoint`, :func:`resolve_resume`.

The resume and rotation names load on first access: ``torch.distributed.checkpoint`` takes over a
second to import, and the loader imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "save_checkpoint": "nemo_wrap.checkpoint.resume",
    "load_checkpoint": "nemo_wrap.checkpoint.resume",
    "CheckpointRotation": "nemo_wrap.checkpoint.rotation",
    "newest_checkpoint": "nemo_wrap.checkpoint.rotation",
    "resolve_resume": "nemo_wrap.checkpoint.rotation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nemo_wrap.checkpoint' has no attribute {name!r}")


__all__ = ["CheckpointRotation", "load_checkpoint", "newest_checkpoint", "resolve_resume", "save_checkpoint"]
