"""Tensor parallel for transformers' own classes, from the plan transformers declares for them.

116 of transformers' causal-LM configs carry a ``base_model_tp_plan`` (module pattern → style name
such as ``"colwise"``), and the model classes a ``_tp_plan`` for ``lm_head``. :class:`DeclaredPlan`
translates those names into torch ``ParallelStyle`` objects applied by nemo_wrap's own tensor
parallel, with the guarantees of our own plans: the embedding is always vocab-parallel (so a tied
``lm_head`` stays the same DTensor as the embedding, and the padding row is zeroed where it lives),
logits are gathered to replicated, and per-head norms get their gradients summed. Entries with no
equivalent here (MoE expert styles, packed weights) raise :class:`ShardingError` naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import PreTrainedModel

from nemo_wrap.distributed.tensor_parallel import ReplicateWithGradientSum, TensorParallelPlan
from nemo_wrap.errors import ShardingError

_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": ReplicateWithGradientSum,
}


def declared_styles(model_class: type[PreTrainedModel]) -> dict[str, str]:
    """Module pattern → transformers' style name, for the whole causal LM (base plan prefixed)."""
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
        unsupported = {pattern: style for pattern, style in styles.items() if style not in _STYLES}
        if unsupported:
            raise ShardingError(
                f"{self.model_class.__name__}: transformers' tensor-parallel plan has entries nemo_wrap cannot "
                f"honour: {unsupported} (supported styles: {sorted(_STYLES)}); use tp_size=1 (fsdp2 or ddp)"
            )
        if not any(style.startswith("embedding") for style in styles.values()):
            styles[f"{self.model_class.base_model_prefix}.embed_tokens"] = "embedding_rowwise"
        return {pattern: _STYLES[style]() for pattern, style in styles.items()}


def declares_a_plan(model_class: type[PreTrainedModel]) -> bool:
    """Whether transformers declares any tensor-parallel entry for the class's decoder."""
    return bool(getattr(model_class.config_class, "base_model_tp_plan", None))
