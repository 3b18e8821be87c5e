"""Finding the parts of a transformers causal LM that sharding treats specially."""

from __future__ import annotations

from torch import nn

from nemo_wrap.errors import ShardingError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks, found through transformers' ``_no_split_modules``.

    FSDP units and Megatron-FSDP units are one decoder block each. A block's class may be the
    subclass ``fully_shard`` swaps in (``FSDP<Name>``), so its bases are matched too.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and _is_block(module[0], block_names):
            return module
    raise ShardingError(
        f"{type(model).__name__}: found no ModuleList of decoder blocks named in _no_split_modules "
        f"({sorted(block_names)}); cannot place FSDP units"
    )


def _is_block(module: nn.Module, block_names: set[str]) -> bool:
    return any(cls.__name__ in block_names for cls in type(module).__mro__)
