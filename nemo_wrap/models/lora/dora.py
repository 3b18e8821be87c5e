"""DoRA (weight-decomposed LoRA) as PEFT computes it, on our adapters' rows.

PEFT's DoRA adds to a layer's output ``o = W·x + b``

    (m / n − 1) ⊙ W·x_d  +  (m / n) ⊙ Δ,        n = ‖W + s·B·A‖ per output row, detached,

where ``x_d`` is the dropped-out input (``x`` itself without dropout, so ``W·x_d = o − b``) and ``Δ``
the LoRA delta ``s·B·A·x_d``: without dropout ``y = b + (m / n) ⊙ (W·x + Δ)``. The magnitude ``m``
starts as the row norms of ``W`` (``B`` is zero), so a fresh adapter changes nothing. Each adapted
projection has its own ``m`` over its own rows, so a fused layer's q, k and v are DoRA'd as
transformers' separate layers are. A 4-bit layer's ``W`` is its dequantized weight, as in PEFT.

Under tensor parallel a column-wise rank holds whole rows of ``W``; a row-wise rank a slice of
every row's columns, so ``n²`` is summed over the tp ranks, and its output — a partial sum — is
scaled row by row, which sums to the scaled whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.errors import ShardingError
from nemo_wrap.initialization.geometry import local_shard, shard_geometry
from nemo_wrap.models.lora.layers import LocalRows, LoraAdapters, adapted_layer, row_index
from nemo_wrap.state_dict import EncodedWeight


def dora_output(
    adapters: LoraAdapters, layer: nn.Module, dropped: torch.Tensor | None, output: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """The adapted layer's output with DoRA: ``output`` is the layer's, ``delta`` the adapters'
    (same layout), ``dropped`` the dropped-out input (``None`` without dropout)."""
    bias = getattr(layer, "bias", None)
    bias = _local(bias) if isinstance(bias, torch.Tensor) else None
    weight = _local_weight(layer)
    group = None
    rows = adapters.whole_rows()
    if isinstance(output, DTensor):
        group = output.device_mesh.get_group()
        rows = adapters.local_rows(output, weight.shape[1])
        if rows.columns != slice(None) and bias is not None:
            raise ShardingError("DoRA on a row-wise tensor-parallel layer with a bias is not supported")
    local = _local(output)
    scale = magnitude_scale(adapters, weight, rows, group).to(local.dtype)
    base = local if dropped is None else _local(layer.forward(dropped))
    base = base if bias is None else base - bias
    result = local + (scale - 1) * base + scale * _local(delta)
    if isinstance(output, DTensor):
        return DTensor.from_local(result, output.device_mesh, output.placements, run_check=False)
    return result


def magnitude_scale(
    adapters: LoraAdapters, weight: torch.Tensor, rows: LocalRows, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``m / ‖W + s·B·A‖`` for each of ``rows`` (1 on rows no pair adapts); ``weight`` holds this
    rank's part of ``W`` (its rows, or under row-wise tp its columns of every row, whose squared
    norms are then summed over the tp ``group``)."""
    with torch.no_grad():
        down = torch.cat([pair.get_parameter("lora_A")[:, rows.columns] for pair in adapters.pairs.values()])
        adapted = weight.to(adapters.dtype) + adapters.placed(rows, "lora_B") @ down
        squared = adapted.square().sum(dim=1)
        if rows.columns != slice(None):  # row-wise: every tp rank holds a part of each row
            dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    magnitude = adapters.placed(rows, "lora_magnitude", scaled=False)
    return torch.where(adapters.covered(rows), magnitude / norm, torch.ones_like(norm))


def merged_weight(adapters: LoraAdapters, weight: torch.Tensor, full: Mapping[str, torch.Tensor], prefix: str) -> None:
    """Merge DoRA adapters into the whole ``weight`` (fp32, in place): each pair's rows become
    ``(m / ‖W + s·B·A‖) ⊙ (W + s·B·A)``; ``full`` holds the whole adapter tensors by our names."""
    for part, placement in adapters.placements.items():
        a, b, m = (
            full[f"{prefix}.pairs.{part}.{name}"].to(torch.float32) for name in ("lora_A", "lora_B", "lora_magnitude")
        )
        index = row_index(placement)
        adapted = weight[index] + (b @ a) * adapters.scalings[part]
        weight[index] = (m / adapted.norm(dim=1)).unsqueeze(1) * adapted


def initialize_magnitudes(model: nn.Module) -> None:
    """Set every DoRA magnitude of ``model`` to its projection's row norms of the weight (PEFT's
    init, with ``B`` zero). Collective when the weights are sharded: every rank calls it."""
    for name, adapters in model.named_modules():
        if not isinstance(adapters, LoraAdapters) or not adapters.uses_dora:
            continue
        weight = _whole_weight(model.get_submodule(adapted_layer(name))).to(torch.float32)
        with torch.no_grad():
            for part, pair in adapters.pairs.items():
                norms = weight[row_index(adapters.placements[part])].norm(dim=1)
                magnitude = pair.get_parameter("lora_magnitude")
                rows = shard_geometry(magnitude, f"{name}.pairs.{part}.lora_magnitude").dim_indices[0]
                local_shard(magnitude).copy_(norms[rows])


def _whole_weight(layer: nn.Module) -> torch.Tensor:
    """The layer's whole weight (gathered, or dequantized): collective when sharded."""
    if isinstance(layer, EncodedWeight):
        return layer.decoded()
    weight = layer.get_parameter("weight")
    return weight.full_tensor() if isinstance(weight, DTensor) else weight


def _local_weight(layer: nn.Module) -> torch.Tensor:
    """This rank's part of the layer's weight during its forward (a 4-bit layer's dequantized)."""
    if isinstance(layer, EncodedWeight):
        return layer.decoded()
    return _local(layer.get_parameter("weight"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
