"""Switching a model's adapters off for a while: the base model, with no second copy of it.

DPO on a LoRA model compares the policy (base and adapters) with a reference, and the base model
is that reference (as PEFT's ``disable_adapter()`` makes it for TRL): while switched off, every
adapted layer computes its base output alone, so the same weights serve both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from nemo_wrap.models.lora.layers import LoraAdapters


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model`` computes as its base model (each :class:`LoraAdapters` off);
    they are switched back on when it ends, whatever happens in it."""
    adapters = [module for module in model.modules() if isinstance(module, LoraAdapters)]
    for module in adapters:
        module.enabled = False
    try:
        yield
    finally:
        for module in adapters:
            module.enabled = True
