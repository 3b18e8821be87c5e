"""Tensor parallel (Megatron-style) for decoder-only LMs, on the ``tp`` axis of the mesh.

The plan for the transformers Llama family (Llama, Qwen2, Qwen3, Mistral share module names):
vocab-parallel embedding (weight ``Shard(0)``, replicated output), column-parallel q/k/v and
gate/up, row-parallel o/down, and a column-parallel lm_head whose output is gathered to
``Replicate`` — a ``Shard(-1)`` logits tensor would make transformers' in-forward loss silently
wrong. Qwen3's per-head ``q_norm``/``k_norm`` act on sharded heads, so their gradients are summed
over the tp ranks (:class:`ReplicateWithGradientSum`). Our own model classes bring their plan
through a ``tensor_parallel_plan()`` classmethod (each model folder's ``parallelize.py``).

The plan is applied with ``src_data_rank=None``: each rank takes its own chunk without a scatter
from rank 0, which is what a meta-device model (no data yet) and a topology-invariant init need.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from nemo_wrap.errors import ShardingError

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


def _llama_family_plan() -> dict[str, ParallelStyle]:
    layer = "model.layers.*"
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def _qwen3_plan() -> dict[str, ParallelStyle]:
    return {
        **_llama_family_plan(),
        "model.layers.*.self_attn.q_norm": ReplicateWithGradientSum(),
        "model.layers.*.self_attn.k_norm": ReplicateWithGradientSum(),
    }


_TRANSFORMERS_PLANS: dict[str, Callable[[], dict[str, ParallelStyle]]] = {
    "llama": _llama_family_plan,
    "mistral": _llama_family_plan,
    "qwen2": _llama_family_plan,
    "qwen3": _qwen3_plan,
}


def check_tensor_parallel_supported(model_or_class: object, config: object, tp_size: int) -> None:
    """Raise :class:`ShardingError` unless ``tp_size``-way tensor parallel is correct for this model.

    Pure and local, so it runs at build time on every rank before any collective. Each rank must
    hold whole attention heads and key/value-head groups (our fused q/k/v layout groups query heads
    by their kv head) and whole gate/up row pairs; the vocabulary need not divide (DTensor shards
    the embedding and lm_head unevenly).
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ShardingError(f"tp_size must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    model_type = getattr(config, "model_type", None)
    if not hasattr(model_or_class, "tensor_parallel_plan") and model_type not in _TRANSFORMERS_PLANS:
        name = getattr(model_or_class, "__name__", type(model_or_class).__name__)
        raise ShardingError(
            f"{name} (model_type={model_type!r}) has no tensor-parallel plan; plans exist for "
            f"{sorted(_TRANSFORMERS_PLANS)} and nemo_wrap's own classes. Use tp_size=1 (fsdp2 or ddp)"
        )
    for attribute in ("num_key_value_heads", "num_attention_heads", "intermediate_size"):
        value = getattr(config, attribute, None)
        if value is not None and value % tp_size != 0:
            raise ShardingError(
                f"tensor parallel needs {attribute} divisible by tp_size: {attribute}={value}, tp_size={tp_size} "
                "(each rank holds whole heads, kv-head groups and gate/up row pairs)"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Parallelize ``model`` in place over ``tp_mesh`` (1-D) and restore weight ties."""
    check_tensor_parallel_supported(model, model.config, tp_mesh.size())
    if hasattr(model, "tensor_parallel_plan"):
        plan = model.tensor_parallel_plan()
    else:
        plan = _TRANSFORMERS_PLANS[model.config.model_type]()
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    # Each style registered a new Parameter, so a tied lm_head now holds its own copy; the
    # embedding and the lm_head are both Shard(0) on the same mesh, so re-tying is exact.
    model.tie_weights()
    return model
