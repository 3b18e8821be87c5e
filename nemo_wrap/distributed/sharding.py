"""Sharding a model as a :class:`DistributedSetup` says: tensor parallel first, then the strategy.

The DDP and FSDP2 strategies shard *in place* and return the same object, so the model stays an
instance of the class it was built as (``PreTrainedModel``, ``NeMoPreTrainedModel``), with
``config``, ``generate`` and ``save_pretrained``: torch's composable ``replicate`` and
``fully_shard`` swap in a generated subclass rather than wrapping. Megatron-FSDP is the documented
exception: it returns its own wrapper, with the model as ``.module``.

Whether this runs on the meta model (before materialization) or on real weights is the load
plan's decision (:mod:`nemo_wrap.loading.plan`), read from the strategy's registry entry.
"""

from __future__ import annotations

from torch import nn

from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.distributed.expert_parallel import ExpertLayout, apply_expert_parallel
from nemo_wrap.distributed.precision import PrecisionPlan, strategy_options
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.tensor_parallel import TensorParallelPlan, apply_tensor_parallel


def shard_model(
    model: nn.Module,
    setup: DistributedSetup,
    tp_plan: TensorParallelPlan | None,
    precision: PrecisionPlan | None = None,
    root: nn.Module | None = None,
    experts: ExpertLayout | None = None,
) -> nn.Module:
    """Apply ``setup`` to ``model`` and return it (or the strategy's wrapper around it).

    The caller (the load pipeline) records the setup in the model's
    :class:`~nemo_wrap.loading.model_state.ModelState`, and checks
    ``setup.entry.check_available()`` first, before any work that would be lost (the load pipeline
    does so before it builds anything). ``precision`` puts its mixed precision
    into the strategy's options where the strategy casts parameters itself (FSDP2). ``root`` is the
    module the strategy wraps when it is not ``model`` itself (a pipeline stage's module, which
    holds ``model``): tensor parallel still applies to ``model``, whose plan names its modules.
    ``experts`` (expert parallel) places each MoE layer's experts on the expert mesh after tensor
    parallel, and the strategy shards them over their own ranks before the rest.
    """
    entry = setup.entry
    mesh = setup.device_mesh()
    if setup.uses_tensor_parallel:
        apply_tensor_parallel(model, mesh[MeshDim.TP], tp_plan)
    options = setup.options if precision is None else strategy_options(precision, setup.strategy, setup.options)
    if experts is not None:
        assert entry.shard_experts is not None  # build() gives ep > 1 only to strategies that take it
        modules = apply_expert_parallel(model, experts, setup.expert_mesh()[MeshDim.EP], mesh[MeshDim.TP])
        entry.shard_experts(modules, setup.expert_sharding_mesh(), options, setup.dp_size)
    wrapped = entry.apply(model if root is None else root, mesh, options)
    return wrapped if root is None else model
