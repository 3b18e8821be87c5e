"""The classes ``NeMoAutoModelForCausalLM`` builds: the resolved class with ``ShardedModelMixin`` first.

The resolved class (:func:`nemo_wrap.models.registry.resolve_model_source`) already initializes
through ``NeMoPreTrainedModel``; composing :class:`ShardedModelMixin` over it adds saving,
synced generation and the load report, and binds the architecture's spec. The composed class keeps
the resolved class's name, qualified name and module: transformers decides "custom code" from
``__module__`` (the wrapped transformers classes must load like the originals), and a model's
class name is what users and tests recognize. It comes from the one class factory
(:func:`~nemo_wrap.initialization.hf_wrapping.derived_class`), cached per (class, spec), so every
load of an architecture returns instances of one class object. Like the ``NeMo<Name>`` wrappers it
cannot be pickled by reference: pickle state dicts, not model objects.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from nemo_wrap.auto.model_mixin import ShardedModelMixin
from nemo_wrap.initialization.hf_wrapping import derived_class
from nemo_wrap.models.registry import ModelSource


def loadable_class(source: ModelSource) -> type[PreTrainedModel]:
    """``source.model_class`` with :class:`ShardedModelMixin` first and ``model_spec`` bound."""
    base = source.model_class
    spec = {"model_spec": source.spec}
    return derived_class(ShardedModelMixin, base, base.__name__, base.__qualname__, base.__doc__, spec)
