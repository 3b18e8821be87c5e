"""Gradient accumulation without a gradient all-reduce / reduce-scatter on every micro-step.

Both torch managers we use (composable ``replicate`` for DDP, ``fully_shard`` for FSDP2) expose
``set_requires_gradient_sync``; a model that is not sharded across ranks needs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Inside, backward passes accumulate local gradients only; the next synced backward reduces all."""
    toggle = getattr(model, "set_requires_gradient_sync", None)
    if toggle is None:
        yield
        return
    toggle(False)
    try:
        yield
    finally:
        toggle(True)
