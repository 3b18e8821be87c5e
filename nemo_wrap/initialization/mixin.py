"""``NeMoPreTrainedModel``: a transformers model whose weight initialization is sharding-proof.

Placed before a transformers ``PreTrainedModel`` class in the MRO (see
:func:`nemo_wrap.initialization.nemo_model_class`), it replaces ``initialize_weights`` and
``_init_weights`` so that initialization is a pure function of (seed, parameter name, config):
the full tensors assembled from any sharding — FSDP2, tensor parallel, both, or none — equal the
one-process result exactly, with no collective.

Why the mixin owns the whole walk: transformers' ``initialize_weights`` hands each nested
``PreTrainedModel`` (``LlamaModel`` inside ``LlamaForCausalLM``) to that submodel's own
``_init_weights``, so overriding the rule on the outer class alone never sees the embedding. Here
one walk visits every module children-first (the order transformers uses, which GPT-2's
depth-scaled projections rely on), applies the rule of the nearest enclosing ``PreTrainedModel``
(so each submodel keeps its own distributions and config), and routes the init functions that
rule calls through :class:`InitSession`.

What is never touched: parameters named in ``loaded_names`` (by name, because ``fully_shard``
replaces parameters and drops attributes such as ``_is_hf_initialized``), tensors that still carry
``_is_hf_initialized``, and tie targets (restored from their source afterwards). Module-level
``_is_hf_initialized`` flags are deliberately *not* honoured: transformers sets them on every
module of a nested submodel when that submodel's ``__init__`` runs its own ``post_init``, so
honouring them would keep transformers' unseeded draws.

The mixin does nothing but initialize: no file I/O, no process-group logic. What a model needs
beyond that to be saved or generated from when sharded lives in a higher layer
(:mod:`nemo_wrap.auto`), composed into the classes ``NeMoAutoModelForCausalLM`` returns.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel

from nemo_wrap.errors import InvalidInitArgumentError
from nemo_wrap.initialization.interception import InitSession
from nemo_wrap.initialization.ties import retie_

if TYPE_CHECKING:
    # The mixin is only ever combined with a ``PreTrainedModel`` class: to the type checker it is
    # one, so ``self`` has the model's attributes and ``super()._init_weights`` resolves. At
    # runtime it stays a plain mixin (its only base is ``object``).
    _MixinBase = PreTrainedModel
else:
    _MixinBase = object


class NeMoPreTrainedModel(_MixinBase):
    """Mixin for a transformers ``PreTrainedModel`` subclass: seeded, sharding-independent init.

    Seed: ``initialize_weights(seed=...)``, else ``torch.initial_seed()`` (so ``torch.manual_seed``
    / ``transformers.set_seed`` before building works as with transformers). Every rank must
    resolve the same seed: an unseeded process draws a random ``initial_seed``, which differs
    between ranks.

    Loaded names: ``initialize_weights(loaded_names=...)``; transformers' own loader instead flags
    loaded tensors ``_is_hf_initialized``, which is honoured too.
    """

    hf_architecture: ClassVar[str]  # the transformers class name that saved configs name

    def initialize_weights(self, loaded_names: Iterable[str] | None = None, seed: int | None = None) -> None:
        """Initialize every parameter and buffer not loaded, then restore tied weights.

        Works on plain tensors and DTensors alike; meta tensors are skipped (call again after
        ``to_empty``). Non-persistent buffers such as rotary ``inv_freq`` are recomputed by the
        model's own rule. Calling it again re-draws the same values for every non-loaded tensor.
        """
        seed = self._nemo_resolve_seed(seed)
        loaded = self._nemo_resolve_loaded(loaded_names)
        tied = self.get_expanded_tied_weights_keys(all_submodels=True)
        session = InitSession(self, seed=seed, loaded_names=loaded, tie_targets=frozenset(tied))
        with session.active():
            _walk(session, self, "", self)
        retie_(self, tied, loaded)

    def _init_weights(self, module: nn.Module) -> None:
        """This class's rule for one module, made seeded and shard-aware.

        Called by transformers outside our walk (``_initialize_weights``, ``resize_token_embeddings``)
        it opens its own session; ``module`` is seeded under its name in this model ("" if detached).
        """
        session = InitSession.current()
        if session is not None:
            session.apply_rule(super()._init_weights, module, session.qualname_of(module))
            return
        session = InitSession(
            self,
            seed=self._nemo_resolve_seed(None),
            loaded_names=self._nemo_resolve_loaded(None),
            tie_targets=frozenset(),
        )
        with session.active():
            session.apply_rule(super()._init_weights, module, session.qualname_of(module))

    def _nemo_resolve_seed(self, seed: int | None) -> int:
        if seed is None:
            return torch.initial_seed()
        try:
            return operator.index(seed)
        except TypeError:
            raise InvalidInitArgumentError(f"seed must be an integer, got {seed!r}") from None

    def _nemo_resolve_loaded(self, loaded_names: Iterable[str] | None) -> frozenset[str]:
        if isinstance(loaded_names, str):
            raise InvalidInitArgumentError(
                f"loaded_names must be a collection of parameter names, got the string {loaded_names!r}"
            )
        return frozenset(loaded_names or ())


def _walk(session: InitSession, module: nn.Module, qualname: str, owner: PreTrainedModel) -> None:
    """Children first, each module under the rule of its nearest enclosing ``PreTrainedModel`` —
    or its own ``init_own_parameters`` when it has one (LoRA adapters, which transformers' rules do
    not know): run under the same session, so it is seeded and shard-aware too."""
    for name, child in module.named_children():
        child_owner = child if isinstance(child, PreTrainedModel) else owner
        _walk(session, child, f"{qualname}.{name}" if qualname else name, child_owner)
    own_rule = getattr(module, "init_own_parameters", None)
    rule = (lambda _: own_rule()) if callable(own_rule) else _class_rule(owner)
    session.apply_rule(rule, module, qualname)


def _class_rule(owner: PreTrainedModel) -> Callable[[nn.Module], None]:
    """The owner class's own ``_init_weights`` (past this mixin, which would re-enter the session)."""
    if isinstance(owner, NeMoPreTrainedModel):
        return super(NeMoPreTrainedModel, owner)._init_weights
    return owner._init_weights
