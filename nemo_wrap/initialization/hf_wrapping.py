"""Deriving ``NeMo<Name>`` from a transformers model class, once per class.

The subclass is ``type(f"NeMo{name}", (NeMoPreTrainedModel, cls), {...})``: the mixin first in
the MRO so its ``initialize_weights`` / ``_init_weights`` win, everything else (forward, config,
loading, tensor-parallel plans) inherited untouched. It is cached so that every caller gets the
same class object (``isinstance`` checks and ``type(model) is ...`` comparisons keep working).

``__module__`` is the wrapped class's module on purpose: transformers decides "custom code" from
``cls.__module__`` and, for custom code, skips its checkpoint key conversions and changes how it
handles tied and already-initialized weights; the wrapped model must load exactly like the
original. A consequence: the class cannot be pickled by reference (its name does not exist in that
module); pickle state dicts, not model objects.

``hf_architecture`` records the transformers class name: transformers would write
``type(self).__name__`` into ``config.json``'s ``architectures`` (``NeMoLlamaForCausalLM``, or
``DDPNeMo…`` after torch's ``replicate``), while inference servers and converters read that field
to pick a class. ``ShardedModelMixin.save_pretrained`` (:mod:`nemo_wrap.auto`) writes ``hf_architecture`` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping

from transformers import PreTrainedModel

from nemo_wrap.errors import NotATransformersModelError
from nemo_wrap.initialization.mixin import NeMoPreTrainedModel

_DERIVED: dict[tuple[type, type, tuple[tuple[str, Hashable], ...]], type] = {}
_LOCK = threading.Lock()


def derived_class(
    mixin: type, base: type, name: str, qualname: str, doc: str | None, attributes: Mapping[str, Hashable]
) -> type:
    """``type(name, (mixin, base), attributes)``, built once per (mixin, base, attributes) and
    cached: the one factory (and cache) behind every class nemo_wrap derives — the ``NeMo<Name>``
    wrappers here, and the classes the loader returns (``nemo_wrap.auto.classes``). One class
    object per key keeps ``isinstance`` and ``type(model) is ...`` working across loads.

    ``__module__`` is the base's (see the module docstring for why).
    """
    key = (mixin, base, tuple(sorted(attributes.items())))
    with _LOCK:
        derived = _DERIVED.get(key)
        if derived is None:
            namespace = {"__module__": base.__module__, "__qualname__": qualname, "__doc__": doc, **attributes}
            derived = _DERIVED[key] = type(name, (mixin, base), namespace)
    return derived


def nemo_model_class(cls: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """Return the cached ``NeMo<Name>`` subclass of the transformers model class ``cls``.

    A class that already has the mixin is returned as is. Raises
    :class:`NotATransformersModelError` if ``cls`` is not a ``PreTrainedModel`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise NotATransformersModelError(f"cls must be a transformers PreTrainedModel subclass, got {cls!r}")
    if issubclass(cls, NeMoPreTrainedModel):
        return cls
    doc = f"{cls.__name__} with nemo_wrap's seeded, sharding-independent initialization."
    name = f"NeMo{cls.__name__}"
    return derived_class(NeMoPreTrainedModel, cls, name, name, doc, {"hf_architecture": cls.__name__})
