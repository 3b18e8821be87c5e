"""Placing whole experts on ranks, with transformers' own expert-parallel layers.

transformers' ``grouped_gemm`` style makes each 3-D expert parameter a ``Shard(0)`` DTensor on the
``ep`` mesh (and sets the module's expert count to the local one), and ``ep_dispatch_experts``
replaces the experts module's forward with its token dispatch (``AutoEP``: all-to-all in
training). It works on the meta model, so each rank allocates, initializes and reads only its own
experts. What it lacks here is applied around it: the plan's ``*`` patterns expanded to this
model's modules, parameters sharded before the module's dispatch is installed (the dispatch reads
the local expert count), and the FSDP of experts over ``efsdp`` left to the strategy.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.distributed.expert_parallel import apply_expert_parallelism

from nemo_wrap.distributed.expert_parallel.layout import EXPERTS_MODULE_STYLE, ExpertLayout
from nemo_wrap.errors import ShardingError


def _matches(pattern: str, name: str) -> bool:
    """``*`` stands for one dotted component (a layer number), as in transformers' plans."""
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(p in ("*", n) for p, n in zip(pattern_parts, parts, strict=True))


def expanded_expert_plan(model: nn.Module, layout: ExpertLayout) -> dict[str, str]:
    """The plan with its patterns resolved to this model's names: parameters first, then modules."""
    names = [name for name, _ in model.named_parameters()]
    modules = [name for name, _ in model.named_modules()]
    parameters = {n: s for p, s in layout.plan if s != EXPERTS_MODULE_STYLE for n in names if _matches(p, n)}
    dispatched = {n: s for p, s in layout.plan if s == EXPERTS_MODULE_STYLE for n in modules if _matches(p, n)}
    if not dispatched:
        raise ShardingError(
            f"{type(model).__name__}: no module matches the expert-parallel patterns {list(layout.module_patterns)}"
        )
    return {**parameters, **dispatched}


def apply_expert_parallel(
    model: nn.Module, layout: ExpertLayout, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh
) -> list[nn.Module]:
    """Shard every MoE layer's experts over ``ep_mesh`` and route tokens to them; the experts modules.

    ``tp_mesh`` holds the ranks that share one batch (size 1 without tensor parallel): each sends
    a disjoint slice of it, so no token reaches an expert twice.
    """
    apply_expert_parallelism(model, ep_mesh, tp_mesh, expanded_expert_plan(model, layout))
    return experts_modules(model, layout)


def experts_modules(model: nn.Module, layout: ExpertLayout) -> list[nn.Module]:
    """The modules tokens are dispatched to: every MoE layer's experts."""
    plan = expanded_expert_plan(model, layout)
    return [model.get_submodule(name) for name, style in plan.items() if style == EXPERTS_MODULE_STYLE]
