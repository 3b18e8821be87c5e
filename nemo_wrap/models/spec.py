"""``ModelSpec``: everything nemo_wrap needs to know about one architecture, in one frozen value.

An architecture is registered by its spec alone — the mapping of architectures is the list of
specs (:mod:`nemo_wrap.models.registry`) — so there is one place to look for which class
implements a config, how its tensors map to a transformers checkpoint, and how it is split under
tensor parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.distributed.tensor_parallel import ReplicateWithGradientSum, TensorParallelPlan
from nemo_wrap.models.conversion import (
    Shapes,
    TransformersConversion,
    conversion_transforms,
    describe_conversion,
    require_supported,
)
from nemo_wrap.state_dict import IdentityAdapter, StateDictAdapter, checkpoint_tensors


@dataclass(frozen=True)
class ModelSpec:
    """One architecture.

    - ``architectures``: the transformers class names it serves (a config's ``architectures[0]``).
    - ``model_class``: our own implementation, or ``None`` for transformers' class itself (wrapped
      with the seeded, shard-aware init mixin).
    - ``state_dict_adapter``: builds, from a config, the adapter between the class's parameter
      names and transformers' checkpoint keys; ``None`` for transformers' own classes, whose keys
      follow transformers' own conversion mapping (renames, merged experts) where it has one.
    - ``tensor_parallel_plan``: the ``parallelize_module`` plan; ``None`` means no tensor parallel.
    - ``sequence_parallel_plan``: the plan with the residual stream cut along the sequence between
      blocks (``sequence_parallel=True``); ``None`` means the architecture has none.
    - ``gradient_sum_modules``: module patterns kept whole under tensor parallel although they act
      on a rank's local heads (Qwen3's q/k norms), whose gradients are summed over the tp ranks.
    """

    architectures: tuple[str, ...]
    model_class: type[PreTrainedModel] | None = None
    state_dict_adapter: Callable[[PretrainedConfig], StateDictAdapter] | None = None
    tensor_parallel_plan: Callable[[], TensorParallelPlan] | None = None
    sequence_parallel_plan: Callable[[], TensorParallelPlan] | None = None
    gradient_sum_modules: tuple[str, ...] = ()

    @property
    def is_custom(self) -> bool:
        """Whether the spec brings its own implementation (else transformers' class is used)."""
        return self.model_class is not None

    def adapter(self, model: PreTrainedModel, checkpoint_shapes: Shapes | None = None) -> StateDictAdapter:
        """The adapter for ``model`` (reading ``checkpoint_shapes``, key → shape, when loading).

        The spec's own adapter if it names one; else transformers' conversion mapping for the
        model's class, or the identity when transformers converts nothing for it.
        """
        if self.state_dict_adapter is not None:
            return self.state_dict_adapter(model.config)
        architecture = cast(str, model.hf_architecture)  # set on every class nemo_wrap builds
        transforms = conversion_transforms(architecture, model.config.model_type)
        if not transforms:
            return IdentityAdapter()
        names = list(checkpoint_tensors(model)[0])
        return TransformersConversion(transforms, model.config, names, model.base_model_prefix, checkpoint_shapes or {})

    def key_mapping(self, architecture: str, model_type: str) -> str:
        """How checkpoint keys become the model's tensors, in words (printed in the load plan)."""
        if self.state_dict_adapter is not None:
            return getattr(self.state_dict_adapter, "__name__", type(self.state_dict_adapter).__name__)
        return describe_conversion(conversion_transforms(architecture, model_type))

    def check_checkpoint_keys(self, architecture: str, model_type: str) -> None:
        """Raise :class:`UnsupportedModelError` before any read if the keys cannot be mapped shard by shard."""
        if self.state_dict_adapter is None:
            require_supported(conversion_transforms(architecture, model_type))

    def parallel_plan(self, sequence_parallel: bool = False) -> TensorParallelPlan | None:
        """The full tensor-parallel plan (with the sequence cut between blocks if asked),
        gradient-summed modules included; ``None`` if there is none."""
        build = self.sequence_parallel_plan if sequence_parallel else self.tensor_parallel_plan
        if build is None:
            return None
        return {
            **build(),
            **{pattern: ReplicateWithGradientSum() for pattern in self.gradient_sum_modules},
        }
