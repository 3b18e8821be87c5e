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

Being the one base of every model nemo_wrap builds (our fused classes and the ``NeMo<Name>``
fallbacks alike), the mixin also carries the behaviour that sharding changes for all of them:
``generate`` kept in lockstep across ranks, and ``save_pretrained`` writing one consolidated
transformers checkpoint from any strategy.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel

from nemo_wrap.errors import InvalidInitArgumentError
from nemo_wrap.initialization.interception import InitSession
from nemo_wrap.initialization.ties import retie_

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class NeMoPreTrainedModel:
    """Mixin for a transformers ``PreTrainedModel`` subclass: seeded, sharding-independent init.

    Seed: ``initialize_weights(seed=...)``, else the ``nemo_init_seed`` attribute, else
    ``torch.initial_seed()`` (so ``torch.manual_seed`` / ``transformers.set_seed`` before building
    works as with transformers). Every rank must resolve the same seed: an unseeded process draws
    a random ``initial_seed``, which differs between ranks.

    Loaded names: ``initialize_weights(loaded_names=...)``, else the ``nemo_loaded_names``
    attribute (for loaders that call ``initialize_weights()`` through transformers).
    """

    hf_architecture: ClassVar[str]  # the transformers class name that saved configs name
    nemo_init_seed: int | None = None
    nemo_loaded_names: frozenset[str] = frozenset()

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

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, kept in lockstep across ranks when sharding needs it.

        A model sharded by nemo_wrap across ranks (``nemo_distributed_setup``) runs collectives in
        every forward (FSDP all-gathers, tensor-parallel reductions, DDP buffer syncs), so a rank
        that meets its EOS early must keep stepping until every rank is done, or the others hang.
        transformers turns ``synced_gpus`` on only for its own FSDP; here it defaults to on for
        ours. An explicit ``synced_gpus=`` argument wins.
        """
        setup = getattr(self, "nemo_distributed_setup", None)
        if setup is not None and setup.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        return super().generate(*args, **kwargs)

    def save_pretrained(
        self,
        save_directory: str | Path,
        max_shard_size: int | str = "50GB",
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """Write a consolidated transformers checkpoint, from one process or every rank of a sharded job.

        transformers' own method cannot serve here: it names ``type(self)`` (``NeMo…``, ``FSDP…``)
        as the architecture, would write our fused keys, and on rank 0 alone under a process group
        can hang the others. See :func:`nemo_wrap.checkpoint.save.save_hf_checkpoint`, which this
        calls: under a process group of more than one rank, every rank must call it (rank 0
        writes); the tokenizer is written when given.
        """
        # imported here: the checkpoint writer reads the model through nemo_wrap.loading, which
        # imports this package
        from nemo_wrap.checkpoint.save import save_hf_checkpoint

        save_hf_checkpoint(self, save_directory, max_shard_size=max_shard_size, tokenizer=tokenizer)

    def _nemo_resolve_seed(self, seed: int | None) -> int:
        chosen = seed if seed is not None else self.nemo_init_seed
        if chosen is None:
            return torch.initial_seed()
        try:
            return operator.index(chosen)
        except TypeError:
            source = "seed" if seed is not None else "nemo_init_seed"
            raise InvalidInitArgumentError(f"{source} must be an integer, got {chosen!r}") from None

    def _nemo_resolve_loaded(self, loaded_names: Iterable[str] | None) -> frozenset[str]:
        chosen = self.nemo_loaded_names if loaded_names is None else loaded_names
        if isinstance(chosen, str):
            source = "loaded_names" if loaded_names is not None else "nemo_loaded_names"
            raise InvalidInitArgumentError(f"{source} must be a collection of parameter names, got the string {chosen!r}")
        return frozenset(chosen)


def _walk(session: InitSession, module: nn.Module, qualname: str, owner: PreTrainedModel) -> None:
    """Children first, each module under the rule of its nearest enclosing ``PreTrainedModel``."""
    for name, child in module.named_children():
        child_owner = child if isinstance(child, PreTrainedModel) else owner
        _walk(session, child, f"{qualname}.{name}" if qualname else name, child_owner)
    session.apply_rule(_class_rule(owner), module, qualname)


def _class_rule(owner: PreTrainedModel) -> Callable[[nn.Module], None]:
    """The owner class's own ``_init_weights`` (past this mixin, which would re-enter the session)."""
    if isinstance(owner, NeMoPreTrainedModel):
        return super(NeMoPreTrainedModel, owner)._init_weights
    return owner._init_weights
