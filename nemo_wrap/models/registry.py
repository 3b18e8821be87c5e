"""Which spec, and which class, implements a config: ours when registered, else transformers'.

``MODEL_ARCH_MAPPING`` is the list of :class:`ModelSpec`; :func:`register_architecture` puts a
spec in front of it, so a later registration wins. Our own implementations (Llama, Qwen2, Qwen3)
serve their architectures unless ``force_hf``; every other causal LM known to transformers falls
back to its transformers class wrapped with the init mixin, with the tensor-parallel plan of a
registered spec that names that class, else the plan transformers declares for it
(:mod:`.declared_plans`).
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from nemo_wrap.errors import DuplicateRegistrationError, UnsupportedModelError
from nemo_wrap.initialization import nemo_model_class
from nemo_wrap.models import llama, qwen2, qwen3
from nemo_wrap.models.config_checks import describe_config
from nemo_wrap.models.declared_plans import DeclaredPlan, declares_a_plan
from nemo_wrap.models.spec import ModelSpec

MODEL_ARCH_MAPPING: list[ModelSpec] = [llama.SPEC, qwen2.SPEC, qwen3.SPEC]


def register_architecture(spec: ModelSpec) -> None:
    """Serve ``spec.architectures`` with ``spec`` from now on.

    A spec of the same kind (a class of our own, or transformers' class) already serving one of
    those architectures is not replaced in silence: :class:`DuplicateRegistrationError` names it
    (remove it from ``MODEL_ARCH_MAPPING`` first to replace it). A transformers-class spec may
    still give a plan to an architecture that has a class of our own (``force_hf=True`` uses it).
    """
    if not isinstance(spec, ModelSpec):
        raise UnsupportedModelError(f"register_architecture expects a ModelSpec, got {spec!r}")
    for architecture in spec.architectures:
        served = _find_spec(architecture, spec.is_custom)
        if served is not None:
            raise DuplicateRegistrationError(
                f"register_architecture: {architecture} is already served by a spec of model class "
                f"{served.model_class.__name__ if served.model_class else 'transformers'}; remove that spec from "
                "MODEL_ARCH_MAPPING first to replace it"
            )
    MODEL_ARCH_MAPPING.insert(0, spec)


@dataclass(frozen=True)
class ModelSource:
    """The spec and class chosen for a config, and why (printed in the load plan).

    ``model_class`` carries the init mixin; it is the spec's own class, or the ``NeMo<Name>``
    wrapper of transformers' class.
    """

    spec: ModelSpec
    model_class: type[PreTrainedModel]
    architecture: str  # the transformers class it stands for: what saved configs name
    reason: str

    @property
    def is_custom(self) -> bool:
        return self.spec.is_custom


def _find_spec(architecture: str | None, custom: bool) -> ModelSpec | None:
    for spec in MODEL_ARCH_MAPPING:
        if spec.is_custom == custom and architecture in spec.architectures:
            return spec
    return None


def _transformers_causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise UnsupportedModelError(
            f"{describe_config(config)}: model_type={getattr(config, 'model_type', None)!r} "
            "is not a causal LM known to transformers' AutoModelForCausalLM"
        )
    # transformers annotates ``_LazyAutoMapping.__getitem__`` as a pair, but it returns the model class.
    return mapping[type(config)]  # type: ignore[return-value]


def _refuse_other_heads(architecture: str | None, config: PretrainedConfig) -> None:
    """A config naming a transformers class with another head (``LlamaForSequenceClassification``,
    ``LlamaModel``) describes weights saved for that head: building a causal LM from them would
    invent an LM head. Names transformers does not know (remote code) fall back to the model type."""
    if architecture is None or architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return
    if any(architecture in spec.architectures for spec in MODEL_ARCH_MAPPING):
        return
    if hasattr(transformers, architecture):
        raise UnsupportedModelError(
            f"{describe_config(config)}: architectures names {architecture}, a transformers class that is "
            "not a causal LM: its weights were saved for another head"
        )


def _transformers_spec(hf_class: type[PreTrainedModel]) -> ModelSpec:
    """A transformers class's spec: its checkpoint keys (and conversion) as transformers has them,
    and the tensor-parallel plan transformers declares for it, if any."""
    plan = DeclaredPlan(hf_class) if declares_a_plan(hf_class) else None
    return ModelSpec(architectures=(hf_class.__name__,), tensor_parallel_plan=plan)


def resolve_model_source(config: PretrainedConfig, force_hf: bool = False) -> ModelSource:
    """Pick the implementation for ``config``: ours when registered (and not ``force_hf``), else HF's."""
    architectures = getattr(config, "architectures", None) or []
    if not isinstance(architectures, (list, tuple)) or not all(isinstance(a, str) for a in architectures):
        raise UnsupportedModelError(
            f"{describe_config(config)}: architectures must be a list of class names, got {repr(architectures)[:100]}"
        )
    architecture = architectures[0] if architectures else None
    _refuse_other_heads(architecture, config)
    custom = None if force_hf else _find_spec(architecture, custom=True)
    if custom is not None and custom.model_class is not None and architecture is not None:
        return ModelSource(custom, custom.model_class, architecture, f"{architecture} has a registered implementation")
    hf_class = _transformers_causal_lm_class(config)
    spec = _find_spec(hf_class.__name__, custom=False) or _transformers_spec(hf_class)
    if force_hf:
        reason = "force_hf=True"
    elif architecture is None:
        reason = "the config names no architecture: transformers' class for its model_type"
    else:
        reason = f"{architecture} has no custom implementation"
    return ModelSource(spec, nemo_model_class(hf_class), hf_class.__name__, reason)
