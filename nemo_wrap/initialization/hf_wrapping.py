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

from transformers import PreTrainedModel

from nemo_wrap.errors import NotATransformersModelError
from nemo_wrap.initialization.mixin import NeMoPreTrainedModel

_WRAPPED: dict[type, type] = {}
_LOCK = threading.Lock()


def nemo_model_class(cls: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """Return the cached ``NeMo<Name>`` subclass of the transformers model class ``cls``.

    A class that already has the mixin is returned as is. Raises
    :class:`NotATransformersModelError` if ``cls`` is not a ``PreTrainedModel`` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise NotATransformersModelError(f"cls must be a transformers PreTrainedModel subclass, got {cls!r}")
    if issubclass(cls, NeMoPreTrainedModel):
        return cls
    with _LOCK:
        wrapped = _WRAPPED.get(cls)
        if wrapped is None:
            name = f"NeMo{cls.__name__}"
            wrapped = type(
                name,
                (NeMoPreTrainedModel, cls),
                {
                    "__module__": cls.__module__,
                    "__qualname__": name,
                    "__doc__": f"{cls.__name__} with nemo_wrap's seeded, sharding-independent initialization.",
                    "hf_architecture": cls.__name__,
                },
            )
            _WRAPPED[cls] = wrapped
    return wrapped
