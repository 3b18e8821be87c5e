"""Which class implements a causal LM: one of our own, or transformers' class with our mixin.

``MODEL_ARCH_MAPPING`` maps a config's ``architectures[0]`` to an import path of our own
implementation, resolved lazily so ``import nemo_wrap`` imports no model code.
:func:`register_architecture` extends it. Every other causal LM known to transformers falls back
to its transformers class wrapped with ``NeMoPreTrainedModel`` (a cached ``NeMo<Name>`` subclass).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.errors import UnsupportedModelError

MODEL_ARCH_MAPPING: dict[str, str] = {
    "LlamaForCausalLM": "nemo_wrap.models.llama:NeMoLlamaForCausalLM",
    "Qwen2ForCausalLM": "nemo_wrap.models.qwen2:NeMoQwen2ForCausalLM",
    "Qwen3ForCausalLM": "nemo_wrap.models.qwen3:NeMoQwen3ForCausalLM",
}


def register_architecture(architecture: str, import_path: str) -> None:
    """Map ``architecture`` (e.g. ``"LlamaForCausalLM"``) to ``"package.module:ClassName"``."""
    if ":" not in import_path:
        raise UnsupportedModelError(
            f"register_architecture({architecture!r}, {import_path!r}): expected 'package.module:ClassName'"
        )
    MODEL_ARCH_MAPPING[architecture] = import_path


@dataclass(frozen=True)
class ModelSource:
    """The class chosen for a config, and why (printed in the load plan)."""

    model_class: type[PreTrainedModel]
    is_custom: bool
    reason: str


def _import_class(import_path: str) -> type[PreTrainedModel]:
    module_name, class_name = import_path.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _transformers_causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise UnsupportedModelError(
            f"config of type {type(config).__name__} (model_type={getattr(config, 'model_type', None)!r}) "
            "is not a causal LM known to transformers' AutoModelForCausalLM"
        )
    return mapping[type(config)]


def resolve_model_source(config: PretrainedConfig, force_hf: bool = False) -> ModelSource:
    """Pick the implementation for ``config``: ours when mapped (and not ``force_hf``), else HF's."""
    from nemo_wrap.initialization import nemo_model_class

    architectures = getattr(config, "architectures", None) or []
    architecture = architectures[0] if architectures else None
    if architecture in MODEL_ARCH_MAPPING and not force_hf:
        return ModelSource(
            _import_class(MODEL_ARCH_MAPPING[architecture]),
            is_custom=True,
            reason=f"{architecture} is in MODEL_ARCH_MAPPING",
        )
    hf_class = _transformers_causal_lm_class(config)
    if force_hf:
        reason = "force_hf=True"
    elif architecture is None:
        reason = "the config names no architecture: transformers' class for its model_type"
    else:
        reason = f"{architecture} has no custom implementation"
    return ModelSource(nemo_model_class(hf_class), is_custom=False, reason=reason)
