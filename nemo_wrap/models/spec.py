"""``ModelSpec``: everything nemo_wrap needs to know about one architecture, in one frozen value.

An architecture is registered by its spec alone — the mapping of architectures is the list of
specs (:mod:`nemo_wrap.models.registry`) — so there is one place to look for which class
implements a config, how its tensors map to a transformers checkpoint, and how it is split under
tensor parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.distributed.tensor_parallel import ReplicateWithGradientSum, TensorParallelPlan
from nemo_wrap.state_dict import IdentityAdapter, StateDictAdapter


@dataclass(frozen=True)
class ModelSpec:
    """One architecture.

    - ``architectures``: the transformers class names it serves (a config's ``architectures[0]``).
    - ``model_class``: our own implementation, or ``None`` for transformers' class itself (wrapped
      with the seeded, shard-aware init mixin).
    - ``state_dict_adapter``: builds, from a config, the adapter between the class's parameter
      names and transformers' checkpoint keys; ``None`` when they are the same.
    - ``tensor_parallel_plan``: the ``parallelize_module`` plan; ``None`` means no tensor parallel.
    - ``gradient_sum_modules``: module patterns kept whole under tensor parallel although they act
      on a rank's local heads (Qwen3's q/k norms), whose gradients are summed over the tp ranks.
    """

    architectures: tuple[str, ...]
    model_class: type[PreTrainedModel] | None = None
    state_dict_adapter: Callable[[PretrainedConfig], StateDictAdapter] | None = None
    tensor_parallel_plan: Callable[[], TensorParallelPlan] | None = None
    gradient_sum_modules: tuple[str, ...] = ()

    @property
    def is_custom(self) -> bool:
        """Whether the spec brings its own implementation (else transformers' class is used)."""
        return self.model_class is not None

    def adapter(self, config: PretrainedConfig) -> StateDictAdapter:
        """The adapter for ``config``: the spec's, or the identity for transformers' own keys."""
        return IdentityAdapter() if self.state_dict_adapter is None else self.state_dict_adapter(config)

    def parallel_plan(self) -> TensorParallelPlan | None:
        """The full tensor-parallel plan, gradient-summed modules included; ``None`` if there is none."""
        if self.tensor_parallel_plan is None:
            return None
        return {
            **self.tensor_parallel_plan(),
            **{pattern: ReplicateWithGradientSum() for pattern in self.gradient_sum_modules},
        }
