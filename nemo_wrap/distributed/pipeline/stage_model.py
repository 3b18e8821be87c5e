"""Keeping one stage's modules in a model built on meta, and the module torch's schedule runs.

A stage keeps transformers' module tree and names (``model.layers.5.mlp…``, so checkpoint keys,
provenance and saves need no renaming) and replaces what it does not hold by parameterless
stand-ins: another stage's decoder layer passes its input through, the final norm of a non-last
stage is the identity, an embedding or LM head held elsewhere raises if called. The backbone's own
forward then runs on every stage — masks, rotary embeddings and per-layer attention types stay
transformers' code — fed with token ids on the first stage and with the received hidden states
(``inputs_embeds``) on the others; the last stage runs the whole causal-LM forward, so a family's
logit scaling or soft-capping applies — or, when the steps' loss is chunked, the backbone and then
that loss of its final hidden states, inside the same forward (:meth:`PipelineStageModule.forward`
says why there), so the ``[tokens, vocabulary]`` logits never exist.

This needs transformers' layout (``<backbone>.layers``, ``.embed_tokens``, ``.norm``, ``lm_head``)
and a backbone that does not rescale ``inputs_embeds`` itself (that would scale every stage's input
again); other families are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from nemo_wrap.distributed.pipeline.layout import StageLayout
from nemo_wrap.errors import PipelineUsageError, UnsupportedModelError

# The last stage's loss from its final (normed) hidden states and its micro-batch's labels.
HeadLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LayerOnAnotherStage(nn.Module):
    """Stands in for a decoder layer another stage holds: its input passes through unchanged."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.index}, held by another pipeline stage"


class ModuleOnAnotherStage(nn.Module):
    """Stands in for the embedding or LM head another stage holds; calling it is a usage error."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise PipelineUsageError(
            f"{self.name} is held by another pipeline stage; run the model through train_step or evaluate"
        )

    def extra_repr(self) -> str:
        return f"{self.name}, held by another pipeline stage"


def check_pipeline_supported(model: PreTrainedModel) -> None:
    """Raise :class:`UnsupportedModelError` naming what a family's structure lacks for pipeline stages
    (its family was checked by :func:`nemo_wrap.models.parallel_support.check_pipelinable` before
    anything was built)."""
    backbone: Any = model.base_model
    missing = [
        f"{type(backbone).__name__}.{name}"
        for name in ("layers", "embed_tokens", "norm")
        if not hasattr(backbone, name)
    ]
    if not hasattr(model, "lm_head"):
        missing.append(f"{type(model).__name__}.lm_head")
    if missing or not isinstance(getattr(backbone, "layers", None), nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__}: pipeline parallel needs transformers' decoder layout "
            f"(<backbone>.layers as a ModuleList, .embed_tokens, .norm, lm_head); missing {missing or ['layers list']}"
        )


def has_tied_embeddings(model: PreTrainedModel) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def keep_stage_modules(model: PreTrainedModel, layout: StageLayout) -> None:
    """Replace, in place, every module ``layout`` does not hold by its stand-in (see module doc)."""
    check_pipeline_supported(model)
    backbone: Any = model.base_model
    for index in range(len(backbone.layers)):
        if index not in layout.layers:
            backbone.layers[index] = LayerOnAnotherStage(index)
    if not layout.holds_embedding:
        backbone.embed_tokens = ModuleOnAnotherStage("embed_tokens")
    if not layout.is_last:
        backbone.norm = nn.Identity()  # the backbone's last step, on the last stage only
    if not layout.holds_head:
        model.lm_head = ModuleOnAnotherStage("lm_head")


def held_parallel_plan(model: nn.Module, plan: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The tensor-parallel plan less the entries naming a module another stage holds (patterns with
    a wildcard match only the stage's own layers: the stand-ins have no submodules to match)."""
    if plan is None:
        return None

    def held(pattern: str) -> bool:
        if "*" in pattern:
            return True
        try:
            module = model.get_submodule(pattern)
        except AttributeError:
            return False
        return not isinstance(module, (ModuleOnAnotherStage, LayerOnAnotherStage, nn.Identity))

    return {pattern: style for pattern, style in plan.items() if held(pattern)}


def held_tied_weights(model: nn.Module, tied: dict[str, str]) -> dict[str, str]:
    """The ``target -> source`` ties of ``tied`` whose both ends this stage holds."""

    def held(name: str) -> bool:
        try:
            model.get_parameter(name)
        except AttributeError:
            return False
        return True

    return {target: source for target, source in tied.items() if held(source) and held(target)}


class PipelineStageModule(nn.Module):
    """The module torch's ``PipelineStage`` runs: one stage's forward over the stage's model.

    It is also the root FSDP unit of the stage (the stage's embedding, norm and head shard with
    it), so torch's schedule manages gradient sync and resharding across micro-batches.
    """

    def __init__(self, model: PreTrainedModel, layout: StageLayout) -> None:
        super().__init__()
        self.language_model: Any = model  # a transformers causal LM (typed loosely: nn.Module's __getattr__)
        self.layout = layout
        self._running = False
        self._head_loss: HeadLoss | None = None

    @property
    def _no_split_modules(self) -> list[str]:  # where FSDP places its per-layer units
        return list(self.language_model._no_split_modules or ())

    @property
    def running(self) -> bool:
        """Whether a schedule is driving the stage now (a forward from elsewhere is refused)."""
        return self._running

    @contextmanager
    def driven(self, head_loss: HeadLoss | None = None) -> Iterator[None]:
        """A schedule drives the stage for the duration; with ``head_loss`` the last stage's forward
        returns that loss wherever it is given ``labels`` (the training layer owns the loss, this
        module only the place it runs in)."""
        self._running, self._head_loss = True, head_loss
        try:
            yield
        finally:
            self._running, self._head_loss = False, None

    def forward(
        self,
        activations: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (first stage) or hidden states (the others) → hidden states; on the last stage
        the logits, or, given ``labels``, the head loss of the final hidden states.

        The loss is computed here rather than by the schedule's ``loss_fn`` on this output because
        this module is the stage's FSDP root: the head's weight is the gathered tensor only between
        FSDP's pre-forward and post-forward hooks (with ``reshard_after_forward="always"`` the
        root reshards after its forward, and a weight read in ``loss_fn`` is
        the rank's ``Shard(0)`` DTensor); and FSDP's pre-backward hook, which gathers the weight
        again for the backward and brings its gradient to the reduce-scatter, is registered on this
        forward's output — here the loss. It is the place the head's own forward would use the
        weight, so the strategy's mixed precision and a tensor-parallel shard apply alike.
        """
        inputs: dict[str, Any] = {"input_ids" if self.layout.is_first else "inputs_embeds": activations}
        inputs.update(position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
        if not self.layout.is_last:
            return self.language_model.base_model(**inputs).last_hidden_state
        if labels is None:
            return self.language_model(**inputs).logits
        if self._head_loss is None:
            raise PipelineUsageError("the last stage was given labels without a loss: drive it with driven(head_loss)")
        return self._head_loss(self.language_model.base_model(**inputs).last_hidden_state, labels)


def refuse_outside_schedule(stage: PipelineStageModule) -> Any:
    """A forward pre-hook for the stage's model: refuse calls that do not come from the schedule."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not stage.running:
            raise PipelineUsageError(
                f"{type(module).__name__} is one stage of a pipeline (layers {stage.layout.layers.start}–"
                f"{stage.layout.layers.stop - 1} of stage {stage.layout.index}): a plain forward or generate "
                "cannot run it; train with nemo_wrap.train_step and evaluate with nemo_wrap.evaluate"
            )

    return hook
