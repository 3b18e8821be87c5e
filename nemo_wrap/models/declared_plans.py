"""Tensor parallel for transformers' own classes, from the plan transformers declares for them.

116 of transformers' causal-LM configs carry a ``base_model_tp_plan`` (module pattern → style name
such as ``"colwise"``), and the model classes a ``_tp_plan`` for ``lm_head``. :class:`DeclaredPlan`
turns those names into ``ParallelStyle`` objects applied by nemo_wrap's tensor parallel, with the
guarantees of our own plans: the embedding is always vocab-parallel (so a tied ``lm_head`` stays the
same DTensor as the embedding, and the padding row is zeroed where it lives), logits are gathered
to replicated, and per-head norms get their gradients summed.

Dense styles become torch's own styles. MoE expert styles have no torch equivalent: there the
entry is handed to transformers' own layer (:class:`TransformersStyle`) — an experts module
(``moe_tp_experts``) with the entries of its parameters (``packed_colwise`` / ``rowwise`` on the
3-D expert tensors), recognised as the entries whose parent path is itself an entry. Styles neither
covers raise :class:`ShardingError` naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import PreTrainedModel
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

from nemo_wrap.distributed.tensor_parallel import ReplicateWithGradientSum, TensorParallelPlan
from nemo_wrap.errors import ShardingError

_TORCH_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": ReplicateWithGradientSum,
}
# Expert modules, and the styles of their 3-D parameters, applied by transformers' own layers.
_EXPERT_MODULE_STYLES = ("moe_tp_experts",)
_EXPERT_PARAMETER_STYLES = ("packed_colwise", "rowwise", "colwise")


class TransformersStyle(ParallelStyle):
    """transformers' own tensor-parallel layer for a module, and for some of its parameters.

    ``parameters`` maps a parameter name of the module to its style name (its sharding); the
    module's style installs the forward that works on the local shards and sums partial outputs.
    """

    def __init__(self, module_style: str, parameters: dict[str, str]) -> None:
        super().__init__()
        self.module_style = module_style
        self.parameters = parameters

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, style in self.parameters.items():
            ALL_PARALLEL_STYLES[style].shard_param(module, name, device_mesh)
        ALL_PARALLEL_STYLES[self.module_style].install_forward(module, device_mesh)
        return module


def declared_styles(model_class: type[PreTrainedModel]) -> dict[str, str]:
    """Module (or parameter) pattern → transformers' style name, for the whole causal LM."""
    prefix = model_class.base_model_prefix
    base_plan = getattr(model_class.config_class, "base_model_tp_plan", None) or {}
    styles = {f"{prefix}.{pattern}": style for pattern, style in base_plan.items()}
    styles.update(getattr(model_class, "_tp_plan", None) or {})
    return styles


@dataclass(frozen=True)
class DeclaredPlan:
    """The tensor-parallel plan transformers declares for ``model_class``, as ``ParallelStyle`` objects.

    A value (frozen, compared by class) so that specs built from it compare equal across loads.
    """

    model_class: type[PreTrainedModel]

    def __call__(self) -> TensorParallelPlan:
        styles = declared_styles(self.model_class)
        if not any(style.startswith("embedding") for style in styles.values()):
            styles[f"{self.model_class.base_model_prefix}.embed_tokens"] = "embedding_rowwise"
        plan: dict[str, ParallelStyle] = {}
        unsupported: dict[str, str] = {}
        for pattern, style in styles.items():
            if pattern.rpartition(".")[0] in styles:
                continue  # a parameter of another entry: applied with its module
            if style in _EXPERT_MODULE_STYLES:
                parameters = _parameters_of(pattern, styles)
                unsupported |= {f"{pattern}.{p}": s for p, s in parameters.items() if s not in _EXPERT_PARAMETER_STYLES}
                plan[pattern] = TransformersStyle(style, parameters)
            elif style in _TORCH_STYLES:
                plan[pattern] = _TORCH_STYLES[style]()
            else:
                unsupported[pattern] = style
        if unsupported:
            raise ShardingError(
                f"{self.model_class.__name__}: transformers' tensor-parallel plan has entries nemo_wrap cannot "
                f"honour: {unsupported}; use tp_size=1 (fsdp2 or ddp)"
            )
        return plan


def _parameters_of(module_pattern: str, styles: dict[str, str]) -> dict[str, str]:
    """The entries directly under ``module_pattern``, by parameter name."""
    prefix = module_pattern + "."
    return {p.removeprefix(prefix): s for p, s in styles.items() if p.rpartition(".")[0] == module_pattern}


def declares_a_plan(model_class: type[PreTrainedModel]) -> bool:
    """Whether transformers declares any tensor-parallel entry for the class's decoder."""
    return bool(getattr(model_class.config_class, "base_model_tp_plan", None))
