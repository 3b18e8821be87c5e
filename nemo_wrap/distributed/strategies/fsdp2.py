"""FSDP2: ``fully_shard`` each decoder layer, then the root (embeddings, final norm, lm_head).

Per-layer groups bound the all-gathered working set to one layer; the root group owns the
embedding and the lm_head together, so a tied embedding ↔ lm_head stays one sharded parameter.
It works on meta-device models, so each rank allocates only its own shards, and it composes with
tensor parallel: on a ``(dp, tp)`` mesh it shards the tensor-parallel DTensors over ``dp``. With
``dp_replicate > 1`` it is HSDP: ``fully_shard`` on the 2-D ``(dp_replicate, dp_shard)`` mesh
reduce-scatters gradients inside a replica and all-reduces them across replicas.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.distributed.strategies.registry import StrategyEntry, always_available, register_strategy
from nemo_wrap.errors import InvalidSetupError


@dataclass(frozen=True)
class FSDP2Options:
    """Options handed to ``torch.distributed.fsdp.fully_shard``.

    ``param_dtype``/``reduce_dtype`` form its ``MixedPrecisionPolicy`` (``None`` keeps the
    parameters' dtype); ``reshard_after_forward=False`` trades memory for one all-gather less.
    ``None`` is torch's own choice: each layer reshards, the root (embeddings, lm_head) does not,
    which saves the root's all-gather at the start of every backward but leaves the root's
    parameters unsharded after a forward that no backward follows (evaluation, generation).
    """

    reshard_after_forward: bool | None = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise InvalidSetupError(f"reshard_after_forward must be a bool or None, got {self.reshard_after_forward!r}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise InvalidSetupError(f"{name} must be a torch.dtype or None, got {value!r}")


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, options: FSDP2Options) -> nn.Module:
    """Shard parameters over the mesh's data-parallel dims — ``dp``, or ``(dp_replicate, dp_shard)``
    for HSDP; a size-1 axis (pure tensor parallel) is left alone."""
    names = mesh.mesh_dim_names or ()
    dp_mesh = _sharding_mesh(mesh, names)
    if dp_mesh.size() == 1:
        return model
    mixed_precision = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mixed_precision, reshard_after_forward=options.reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mixed_precision, reshard_after_forward=options.reshard_after_forward)
    return model


def shard_experts(
    experts: list[nn.Module], mesh: DeviceMesh, options: FSDP2Options, gradient_divide_factor: int
) -> None:
    """FSDP over the ranks that hold the same experts (``efsdp``, and the replicas under HSDP).

    Each expert's gradient already sums the tokens every rank of its expert group sent it, so the
    sum over ``mesh`` covers every data-parallel rank's tokens once: it is divided by the
    data-parallel degree (``gradient_divide_factor``), not by ``mesh``'s size (as transformers does).
    A divisor other than the group size would be reduced with PREMUL_SUM, which gloo rejects, so
    gradients are summed and divided locally — unless the shard dim (the last) has one rank: there
    FSDP2 skips the reduce-scatter and divides while copying, and a forced sum would divide again
    (measured under HSDP; transformers makes the same exception). Applied before the layers' own
    FSDP, which then leaves the experts' parameters to these groups.
    """
    mixed_precision = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
    for module in experts:
        sharded = fully_shard(
            module, mesh=mesh, mp_policy=mixed_precision, reshard_after_forward=options.reshard_after_forward
        )
        sharded.set_gradient_divide_factor(float(gradient_divide_factor))
        if mesh.size(mesh.ndim - 1) > 1:
            sharded.set_force_sum_reduction_for_comms(True)


def _sharding_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The dims FSDP shards over: dp — times cp under context parallel (each cp rank computes
    gradients for every parameter from its part of the sequence) — and HSDP's 2-D form."""
    if MeshDim.CP in names:
        return mesh[MeshDim.DP_REPLICATE, MeshDim.DP_SHARD_CP] if MeshDim.DP_REPLICATE in names else mesh[MeshDim.DP_CP]
    return mesh[MeshDim.DP_REPLICATE, MeshDim.DP_SHARD] if MeshDim.DP_REPLICATE in names else mesh[MeshDim.DP]


def with_mixed_precision(options: FSDP2Options, compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> FSDP2Options:
    """``options`` whose policy gathers parameters in ``compute_dtype`` and reduces gradients in
    ``reduce_dtype``; :class:`InvalidSetupError` if the setup already set other dtypes."""
    for name, wanted in (("param_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
        given = getattr(options, name)
        if given is not None and given != wanted:
            raise InvalidSetupError(
                f"DistributedSetup.build(..., {name}={given}) conflicts with the precision, which sets "
                f"{name}={wanted}: pass one of them"
            )
    return dataclasses.replace(options, param_dtype=compute_dtype, reduce_dtype=reduce_dtype)


FSDP2 = register_strategy(
    StrategyEntry(
        name="fsdp2",
        options_class=FSDP2Options,
        shards_on_meta=True,
        shards_parameters=True,
        degrees=(MeshDim.TP, MeshDim.DP_REPLICATE, MeshDim.CP, MeshDim.PP, MeshDim.EP),
        kept_mesh_dims=(MeshDim.TP,),
        apply=apply_fsdp2,
        check_available=always_available,
        mixed_precision_options=with_mixed_precision,
        shard_experts=shard_experts,
    )
)
