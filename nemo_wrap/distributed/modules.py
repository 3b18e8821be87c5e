"""Finding the parts of a transformers causal LM that sharding treats specially."""

from __future__ import annotations

from torch import nn

from nemo_wrap.errors import ShardingError


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks this rank holds, found through transformers' ``_no_split_modules``.

    FSDP units and Megatron-FSDP units are one decoder block each. A block's class may be the
    subclass ``fully_shard`` swaps in (``FSDP<Name>``), so its bases are matched too. A pipeline
    stage's list also holds stand-ins for other stages' blocks; they are left out.
    """
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and any(_is_block(layer, block_names) for layer in module):
            return [layer for layer in module if _is_block(layer, block_names)]
    raise ShardingError(
        f"{type(model).__name__}: found no ModuleList of decoder blocks named in _no_split_modules "
        f"({sorted(block_names)}); cannot place FSDP units"
    )


def _is_block(module: nn.Module, block_names: set[str]) -> bool:
    return any(cls.__name__ in block_names for cls in type(module).__mro__)
