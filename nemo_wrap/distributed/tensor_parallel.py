"""Tensor parallel (Megatron-style) for decoder-only LMs, on the ``tp`` axis of the mesh.

The plan — which module gets which ``ParallelStyle`` — is the model's knowledge and comes from its
spec (:mod:`nemo_wrap.models`); this module applies a plan and checks that a model can take one.
The typical plan: vocab-parallel embedding (weight ``Shard(0)``, replicated output), column-parallel
q/k/v and gate/up, row-parallel o/down, and a column-parallel lm_head whose output is gathered to
``Replicate`` — a ``Shard(-1)`` logits tensor would make transformers' in-forward loss silently
wrong. Parameters applied to *sharded* activations but kept whole (Qwen3's per-head
``q_norm``/``k_norm``) need their gradients summed over the tp ranks: :class:`ReplicateWithGradientSum`.

The plan is applied with ``src_data_rank=None``: each rank takes its own chunk without a scatter
from rank 0, which is what a meta-device model (no data yet) and a topology-invariant init need.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from nemo_wrap.errors import ShardingError
from nemo_wrap.validation import require_positive_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TensorParallelPlan = Mapping[str, ParallelStyle]


class ReplicateWithGradientSum(ParallelStyle):
    """Leave a module's parameters whole on every rank, but sum their gradients over the tp mesh.

    For parameters applied to *sharded* activations: Qwen3's per-head ``q_norm``/``k_norm`` see
    only the local heads, so each rank's gradient is a partial sum over heads (and the replicas
    would drift apart). The forward needs no collective. The hook is attached to each parameter on
    first use and acts on the gradient before it is accumulated into ``.grad``, so gradient
    accumulation over micro-batches stays correct; attaching at forward time also covers
    parameters replaced after parallelization (``to_empty``, FSDP2).
    """

    _MARK = "_nemo_tp_gradient_sum"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def attach_gradient_sum(module: nn.Module, args: tuple) -> None:
            if not torch.is_grad_enabled():
                return
            for parameter in module.parameters(recurse=False):
                # marked on the parameter object: a replaced parameter is hooked afresh
                if parameter.requires_grad and not getattr(parameter, self._MARK, False):
                    parameter.register_hook(partial(_sum_over_group, group=group))
                    setattr(parameter, self._MARK, True)

        module.register_forward_pre_hook(attach_gradient_sum)
        return module


def _sum_over_group(gradient: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    summed = gradient.clone()
    dist.all_reduce(summed, group=group)
    return summed


def check_tensor_parallel_supported(
    plan: TensorParallelPlan | None, config: object, tp_size: int, model_name: str
) -> None:
    """Raise :class:`ShardingError` unless ``tp_size``-way tensor parallel is correct for this model.

    Pure and local, so it runs on every rank before any collective. ``plan`` is ``None`` when the
    model's spec declares none. Each rank must hold whole attention heads and key/value-head groups
    (our fused q/k/v layout groups query heads by their kv head) and whole gate/up row pairs; the
    vocabulary need not divide (DTensor shards the embedding and lm_head unevenly).
    """
    require_positive_int(tp_size, "tp_size", ShardingError)
    if tp_size == 1:
        return
    if plan is None:
        raise ShardingError(
            f"{model_name} (model_type={getattr(config, 'model_type', None)!r}) has no tensor-parallel plan; "
            "register a ModelSpec with one (see README, 'Adding an architecture') or use tp_size=1 (fsdp2 or ddp)"
        )
    for attribute in ("num_key_value_heads", "num_attention_heads", "intermediate_size"):
        value = getattr(config, attribute, None)
        if value is not None and value % tp_size != 0:
            raise ShardingError(
                f"tensor parallel needs {attribute} divisible by tp_size: {attribute}={value}, tp_size={tp_size} "
                "(each rank holds whole heads, kv-head groups and gate/up row pairs)"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan | None) -> nn.Module:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh`` with ``plan`` and restore weight ties.

    Raises :class:`ShardingError` (see :func:`check_tensor_parallel_supported`) for a missing plan
    or head counts that do not divide.
    """
    check_tensor_parallel_supported(plan, model.config, tp_mesh.size(), type(model).__name__)
    trainable = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    parallelize_module(model, tp_mesh, dict(plan or {}), src_data_rank=None)
    # SequenceParallel registers each norm weight anew as a Parameter, which takes gradients: a
    # weight frozen before (everything but the adapters, under LoRA) would silently train.
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(trainable[name])
    # Each style registered a new Parameter, so a tied lm_head now holds its own copy; the
    # embedding and the lm_head are both Shard(0) on the same mesh, so re-tying is exact.
    cast("PreTrainedModel", model).tie_weights()  # a transformers model: its spec gave the plan
    return model
