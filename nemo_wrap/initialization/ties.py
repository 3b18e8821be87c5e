"""Restoring tied weights after initialization, without touching loaded ones.

``to_empty`` breaks ties (each alias gets its own storage), and the walk leaves tie targets alone
(they are about to be overwritten), so after the walk each tied pair is made equal again:

- plain tensors are tied by identity, as transformers' ``tie_weights`` does (``setattr`` of the
  source parameter onto the target's module), so training keeps them tied;
- DTensors are tied by value, shard by shard, because replacing a parameter object under FSDP2
  would detach it from the FSDP parameter group that all-gathers it. Both must have the same
  mesh and placements; otherwise the local shards do not correspond and
  :class:`TiedWeightLayoutError` is raised.

Direction follows transformers' loading rule: the loaded side wins; if both sides are loaded, the
pair is left as loaded (transformers then warns and unties when the values differ).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.errors import TiedWeightLayoutError
from nemo_wrap.initialization.geometry import local_shard


def retie_(model: nn.Module, tied: Mapping[str, str], loaded_names: frozenset[str]) -> None:
    """Make every ``target -> source`` pair of ``tied`` equal after initialization (see module doc)."""
    for target, source in tied.items():
        if target in loaded_names and source in loaded_names:
            continue
        # The side that was loaded is the one to keep; otherwise the source (initialized) wins.
        destination, origin = (source, target) if target in loaded_names else (target, source)
        destination_param = model.get_parameter(destination)
        origin_param = model.get_parameter(origin)
        if destination_param is origin_param:
            continue
        if isinstance(destination_param, DTensor) or isinstance(origin_param, DTensor):
            _copy_shards(destination, destination_param, origin, origin_param)
        else:
            parent, _, attr = destination.rpartition(".")
            setattr(model.get_submodule(parent), attr, origin_param)


def _copy_shards(destination: str, to: torch.Tensor, origin: str, source: torch.Tensor) -> None:
    same_layout = (
        isinstance(to, DTensor)
        and isinstance(source, DTensor)
        and to.shape == source.shape
        and to.device_mesh == source.device_mesh
        and tuple(to.placements) == tuple(source.placements)
    )
    if not same_layout:
        raise TiedWeightLayoutError(
            f"tied parameters '{destination}' and '{origin}' are laid out differently "
            f"({_layout(to)} vs {_layout(source)}); shard them alike to tie them"
        )
    with torch.no_grad():
        local_to, local_source = local_shard(to), local_shard(source)
        if not local_to.is_meta and not local_source.is_meta:
            local_to.copy_(local_source)


def _layout(tensor: torch.Tensor) -> str:
    if isinstance(tensor, DTensor):
        return f"{tuple(tensor.shape)} {tuple(tensor.placements)} on mesh {tuple(tensor.device_mesh.shape)}"
    return f"plain {tuple(tensor.shape)}"
