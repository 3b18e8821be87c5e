"""Tensor parallelism for the fused decoder: the plan, its preconditions, and tie restoration.

Megatron-style: the fused ``qkv_proj`` and ``gate_up_proj`` are column-parallel (``Shard(0)`` of
the weight, local outputs), ``o_proj`` and ``down_proj`` row-parallel (``Shard(1)``, all-reduced
replicated outputs), the embedding vocab-parallel and ``lm_head`` column-parallel with its logits
gathered, so the loss sees whole, replicated logits. The fused layouts (:mod:`.layouts`) make each
rank's ``Shard(0)`` chunk a complete set of kv-head groups and gate/up row pairs, and the modules
read their local head counts from their local output widths, so no module needs to know ``tp``.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from transformers import PreTrainedConfig

from nemo_wrap.errors import TensorParallelCompatibilityError, TiedWeightLayoutError


def check_tensor_parallel_compatible(config: PreTrainedConfig, tp_size: int) -> None:
    """Raise :class:`TensorParallelCompatibilityError` unless ``config`` splits evenly over ``tp_size``.

    Each rank must hold whole kv-head groups (``num_key_value_heads % tp_size == 0``) and whole
    gate/up row pairs (``intermediate_size % tp_size == 0``). The vocabulary need not divide:
    uneven ``Shard(0)`` of the embedding and ``lm_head`` is handled by DTensor.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelCompatibilityError(f"tp_size must be a positive integer, got {tp_size!r}")
    for field, unit in (("num_key_value_heads", "key/value-head groups"), ("intermediate_size", "gate/up row pairs")):
        value = getattr(config, field)
        if value % tp_size:
            raise TensorParallelCompatibilityError(
                f"{field}={value} is not divisible by tp_size={tp_size}: each rank must hold whole {unit}"
            )


def decoder_tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """The plan shared by Llama, Qwen2 and Qwen3, for ``parallelize_module(model, tp_mesh, plan)``."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.*.self_attn.qkv_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


class ReplicateWithGradientSum(ParallelStyle):
    """Leave a module's parameters whole on every rank, but sum their gradients over the TP mesh.

    For parameters applied to *sharded* activations: Qwen3's per-head ``q_norm``/``k_norm`` see only
    the local heads, so each rank's gradient is a partial sum over heads. The forward needs no
    collective. The hook is attached to each parameter on first use and acts on the gradient
    before it is accumulated into ``.grad``, so gradient accumulation over micro-batches stays
    correct; attaching at forward time (not here) also covers parameters replaced after
    parallelization.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hooked: weakref.WeakSet[nn.Parameter] = weakref.WeakSet()
        group = device_mesh.get_group()

        def attach_gradient_sum(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled():
                return
            for parameter in module.parameters(recurse=False):
                if parameter.requires_grad and parameter not in hooked:
                    parameter.register_hook(partial(_sum_over_group, group=group))
                    hooked.add(parameter)

        module.register_forward_pre_hook(attach_gradient_sum)
        return module


def _sum_over_group(gradient: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    summed = gradient.clone()
    dist.all_reduce(summed, group=group)
    return summed


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """Check the config, ``parallelize_module`` with ``plan``, then restore the embedding tie.

    ``parallelize_module`` distributes ``embed_tokens.weight`` and ``lm_head.weight`` one module at
    a time, so a tied pair comes out as two separate DTensors; the tie is restored by pointing
    ``lm_head.weight`` at the embedding's DTensor parameter, which has the same ``Shard(0)``
    placement on the same mesh.
    """
    check_tensor_parallel_compatible(model.config, tp_mesh.size())
    parallelize_module(model, tp_mesh, plan)
    if model.config.tie_word_embeddings:
        embedding = model.model.embed_tokens.weight
        head_placements = getattr(model.lm_head.weight, "placements", None)
        if head_placements != getattr(embedding, "placements", None):
            raise TiedWeightLayoutError(
                f"lm_head.weight has placements {head_placements} but the tied "
                f"model.embed_tokens.weight has {getattr(embedding, 'placements', None)}"
            )
        model.lm_head.weight = embedding
    return model
