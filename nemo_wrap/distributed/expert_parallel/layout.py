"""Which experts each rank holds, decided from the config and the degrees alone (pure data).

transformers declares, per MoE family, an expert-parallel plan (``base_model_ep_plan``): the experts
module of each MoE layer (``ep_dispatch_experts``: tokens reach it by all-to-all) and its 3-D
parameters stacked over experts (``grouped_gemm``: split on the expert dim). Under ``ep_size=E``
the ``E`` ranks of an expert group hold consecutive, equal runs of every MoE layer's experts —
rank ``r`` of the group experts ``r·n/E … (r+1)·n/E − 1`` — and the ``efsdp = dp_shard · tp / E``
ranks that hold the same experts shard them further with FSDP (transformers' ``efsdp``).
:func:`expert_layout` refuses, naming the value, a dense model, a family transformers declares no
plan for, and an ``ep_size`` that does not divide the experts — in ``plan()`` as at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.distributed.degrees import ParallelDegrees
from nemo_wrap.errors import ShardingError

# The styles of transformers' expert-parallel plans nemo_wrap applies (with transformers' own layers).
EXPERTS_MODULE_STYLE = "ep_dispatch_experts"
EXPERT_PARAMETER_STYLE = "grouped_gemm"
# Where configs keep the number of routed experts per MoE layer (Mixtral, Qwen-MoE/OLMoE, DeepSeek).
_EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
_Style = TypeVar("_Style")


@dataclass(frozen=True)
class ExpertLayout:
    """The experts of every MoE layer split over ``ep`` ranks, each run FSDP-sharded over ``efsdp``.

    ``plan`` maps transformers' module/parameter patterns (``model.layers.*.mlp.experts``) to styles.
    """

    num_experts: int
    ep: int
    efsdp: int
    plan: tuple[tuple[str, str], ...]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    def experts_of(self, ep_rank: int) -> range:
        """The global expert indices rank ``ep_rank`` of an expert group holds, in every MoE layer."""
        return range(ep_rank * self.experts_per_rank, (ep_rank + 1) * self.experts_per_rank)

    @property
    def module_patterns(self) -> tuple[str, ...]:
        """The experts modules' patterns (the modules tokens are dispatched to)."""
        return tuple(pattern for pattern, style in self.plan if style == EXPERTS_MODULE_STYLE)

    def without_expert_entries(self, tensor_plan: Mapping[str, _Style]) -> dict[str, _Style]:
        """A tensor-parallel plan minus its entries for the experts (and their parameters): experts
        under expert parallel are whole, never tensor-split (as transformers drops them too)."""
        return {
            pattern: style
            for pattern, style in tensor_plan.items()
            if not any(pattern == m or pattern.startswith(m + ".") for m in self.module_patterns)
        }

    def describe(self) -> list[str]:
        """One line per fact, for the load plan."""
        owners = "; ".join(
            f"ep rank {r}: experts {self.experts_of(r).start}–{self.experts_of(r).stop - 1}" for r in range(self.ep)
        )
        return [
            f"{self.num_experts} experts per MoE layer ({', '.join(self.module_patterns)}) over ep={self.ep}: {owners}",
            f"tokens travel to their experts' rank by all-to-all and back (transformers' AllToAllEP); each run "
            f"of experts FSDP-sharded over efsdp={self.efsdp}; a rank reads only its share of its experts",
        ]


def declared_expert_plan(model_class: type[PreTrainedModel]) -> dict[str, str]:
    """transformers' expert-parallel plan for the whole causal LM (patterns under the base model)."""
    prefix = model_class.base_model_prefix
    plan = getattr(model_class.config_class, "base_model_ep_plan", None) or {}
    return {f"{prefix}.{pattern}": style for pattern, style in plan.items()}


def applicable_expert_plan(model_class: type[PreTrainedModel]) -> dict[str, str] | None:
    """transformers' expert-parallel plan for ``model_class`` if nemo_wrap applies it (it dispatches
    tokens to an experts module, with only the styles nemo_wrap applies), else None."""
    plan = declared_expert_plan(model_class)
    styles = set(plan.values())
    applies = EXPERTS_MODULE_STYLE in styles and styles <= {EXPERTS_MODULE_STYLE, EXPERT_PARAMETER_STYLE}
    return plan if applies else None


def expert_count(config: PretrainedConfig) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return next((int(getattr(config, f)) for f in _EXPERT_COUNT_FIELDS if getattr(config, f, None)), 0)


def expert_layout(
    config: PretrainedConfig, model_class: type[PreTrainedModel], degrees: ParallelDegrees
) -> ExpertLayout | None:
    """The layout ``degrees.ep`` gives ``model_class``'s experts; None without expert parallel.

    Raises :class:`ShardingError` naming ``ep_size`` for a dense model, a family without a declared
    plan (or with styles nemo_wrap does not apply), and an ``ep_size`` not dividing the experts.
    """
    if degrees.ep == 1:
        return None
    name, count = model_class.__name__, expert_count(config)
    if count == 0:
        raise ShardingError(
            f"ep_size={degrees.ep}: {name} (model_type={config.model_type!r}) is a dense model with no experts; "
            "use ep_size=1"
        )
    plan = applicable_expert_plan(model_class)
    if plan is None:
        raise ShardingError(
            f"ep_size={degrees.ep}: transformers declares no expert-parallel plan nemo_wrap can apply for {name} "
            f"(base_model_ep_plan={declared_expert_plan(model_class) or None}); use ep_size=1"
        )
    if count % degrees.ep != 0:
        working = [n for n in range(1, count + 1) if count % n == 0]
        raise ShardingError(
            f"ep_size={degrees.ep} does not divide the {count} experts of each MoE layer of {name}; "
            f"choose ep_size from {working}"
        )
    return ExpertLayout(count, degrees.ep, degrees.efsdp, tuple(plan.items()))
