"""FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head).

Per-layer groups bound the all-gathered working set to one layer; the root group owns the
embedding and the lm_head together, so a tied embedding ↔ lm_head stays one sharded parameter.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from nemo_wrap.distributed.setup import FSDP2Options
from nemo_wrap.errors import ShardingError


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of transformer blocks, found through transformers' ``_no_split_modules``."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in block_names:
            return module
    raise ShardingError(
        f"{type(model).__name__}: found no ModuleList of decoder blocks named in _no_split_modules "
        f"({sorted(block_names)}); cannot place FSDP2 groups"
    )


def apply_fsdp2(model: nn.Module, dp_mesh: DeviceMesh, options: FSDP2Options) -> nn.Module:
    """Shard parameters over ``dp_mesh`` (works on meta-device models: materialize afterwards)."""
    mixed_precision = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mixed_precision, reshard_after_forward=options.reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mixed_precision, reshard_after_forward=options.reshard_after_forward)
    return model
