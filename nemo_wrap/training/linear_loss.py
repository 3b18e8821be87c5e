"""The causal-LM loss from the final hidden states, a chunk of tokens at a time.

The full path computes ``lm_head`` over every token and hands the ``[tokens, vocabulary]`` logits
to the loss, which keeps them, their fp32 upcast and their gradient alive at the step's peak; for a
real vocabulary that outweighs everything else a small model's step holds. Here the head's matmul
and the cross-entropy run on ``chunk_tokens`` tokens at a time, and each chunk's gradients are
computed with its loss, so its logits are freed before the next chunk's exist: only
``[chunk_tokens, vocabulary]`` is ever alive, and no matmul is recomputed.

The loss is computed inside the model's own forward — in transformers' ``loss_function`` slot,
with the head projecting only the last position (``logits_to_keep=1``) — so the head's weight is
what the strategy makes of it there: gathered by FSDP2's root pre-forward (kept gathered into the
backward by default; with ``reshard_after_forward="always"`` gathered again there by FSDP's hooks
on the forward's ``loss`` output), a replica under DDP, and under
tensor parallel the rank's vocabulary shard: the loss is then torch's vocab-parallel
cross-entropy (``loss_parallel``), each rank reducing its own slice of every chunk, no rank holding
a gathered row of logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from nemo_wrap.loading.model_state import loss_plan_of, setup_of
from nemo_wrap.loading.plan import LossPath, LossPlan
from nemo_wrap.models.head import HeadTransform
from nemo_wrap.training.router_loss import adds_router_loss
from nemo_wrap.training.token_loss import IGNORE_INDEX


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token label (the last position predicts nothing), padded as
    transformers' causal-LM loss shifts them, so the hidden states are used unsliced."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, transform: HeadTransform
) -> torch.Tensor:
    """The summed cross-entropy of ``transform(hidden @ weight.T)`` against ``labels`` (already
    shifted, ``-100`` ignored), in fp32, ``chunk_tokens`` label tokens at a time.

    ``hidden``: ``[..., hidden_size]`` and ``labels`` of the same leading shape; ``weight``: the
    head's, a tensor or a vocabulary-sharded DTensor (tensor parallel). Where gradients are wanted,
    each chunk's are computed with its loss (its logits then freed): the backward only scales them.
    """
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        return _chunked_sum(flat_hidden, weight, flat_labels, chunk_tokens, transform, (False, False))[0]
    summed = _ChunkedCrossEntropy.apply(flat_hidden, weight, flat_labels, chunk_tokens, transform)
    return cast(torch.Tensor, summed)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The sum's gradients are computed in the forward, chunk by chunk (one forward and two
    backward matmuls a chunk, as the full path does: nothing is recomputed), and kept until the
    backward — ``[tokens, hidden]`` and ``[vocabulary, hidden]``, never ``[tokens, vocabulary]``.
    The backward scales them in place (a second ``[vocabulary, hidden]`` at the step's peak would
    cost what a chunk's logits do); a second backward through a retained graph is then refused by
    autograd's own check on modified saved tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        transform: HeadTransform,
    ) -> torch.Tensor:
        wanted = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        total, grad_hidden, grad_weight = _chunked_sum(hidden, weight, labels, chunk_tokens, transform, wanted)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return *saved_gradients_scaled(ctx, grad_total), None, None, None


def saved_gradients_scaled(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The backward of a loss whose forward computed and saved its gradients (hidden states,
    weight): them times the loss's incoming gradient, in place, the weight's in the weight's dtype
    (``ctx.weight_dtype``)."""
    # a plain scalar: it scales a vocabulary-sharded DTensor too; a dry run's fake one has no value
    scale = 1.0 if isinstance(grad_total, FakeTensor) else float(grad_total)
    grad_hidden, grad_weight = ctx.saved_tensors
    grad_hidden = None if grad_hidden is None else grad_hidden.mul_(scale)
    grad_weight = None if grad_weight is None else grad_weight.mul_(scale).to(ctx.weight_dtype)
    return grad_hidden, grad_weight


_Gradients = tuple[torch.Tensor | None, torch.Tensor | None]  # (hidden states, weight): where wanted


def _chunked_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    transform: HeadTransform,
    wanted: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The loss sum and, for the inputs ``wanted`` (hidden states, weight), its gradients (the
    weight's summed over the chunks in fp32, whatever the weight's dtype, as one matmul would).
    Only label tokens are projected: a prompt's or padding's rows add nothing, not even work."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    gradients = (
        torch.zeros_like(hidden) if wanted[0] else None,
        torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None,  # summed over chunks
    )
    add_chunk = _add_vocab_parallel_chunk if isinstance(weight, DTensor) else _add_chunk
    for rows in (labels != IGNORE_INDEX).nonzero().squeeze(-1).split(chunk_tokens):
        total += add_chunk(hidden[rows].detach(), weight.detach(), labels[rows], transform, (rows, gradients))
    return total, gradients[0], gradients[1]


def _add_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    transform: HeadTransform,
    into: tuple[torch.Tensor, _Gradients],
) -> torch.Tensor:
    """A chunk's loss sum; its gradients added ``into`` the gradients at its ``rows``. Written
    out, in place in the one ``[chunk, vocabulary]`` buffer, where autograd would keep the
    log-softmax and its gradient beside the logits."""
    rows, (grad_hidden, grad_weight) = into
    logits = F.linear(hidden, weight).float()
    slope = transform.apply_(logits)  # the transform's derivative, where it is not the identity
    loss = _cross_entropy_sum_(logits, labels)
    if grad_hidden is None and grad_weight is None:
        return loss
    logits.scatter_add_(1, labels.unsqueeze(1), logits.new_full((len(labels), 1), -1.0))  # softmax − one-hot
    grad_logits = (logits if slope is None else logits.mul_(slope)).to(weight.dtype)
    if grad_hidden is not None:
        grad_hidden[rows] = (grad_logits @ weight).to(grad_hidden.dtype)
    if grad_weight is not None and grad_logits.dtype == hidden.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.T, hidden)  # in place: no second [vocabulary, hidden]
    elif grad_weight is not None:
        grad_weight += (grad_logits.T @ hidden).float()
    return loss


def _cross_entropy_sum_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of fp32 ``logits`` (every label a class), leaving their softmax
    in their place."""
    target = logits.gather(1, labels.unsqueeze(1)).squeeze(1)
    top = logits.amax(dim=1, keepdim=True)
    exponentials = logits.sub_(top).exp_()
    sums = exponentials.sum(dim=1, keepdim=True)
    exponentials.div_(sums)
    return (top + sums.log()).squeeze(1).sub_(target).sum()


def _add_vocab_parallel_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    transform: HeadTransform,
    into: tuple[torch.Tensor, _Gradients],
) -> torch.Tensor:
    """:func:`_add_chunk` for a vocabulary-sharded weight, through torch's vocab-parallel
    cross-entropy (``loss_parallel``): each rank reduces its own slice of the chunk's logits."""
    rows, (grad_hidden, grad_weight) = into
    mesh = cast(DTensor, weight).device_mesh  # every rank holds the same hidden states and labels
    with torch.enable_grad():
        chunk_hidden = hidden.requires_grad_(grad_hidden is not None)
        chunk_weight = weight.requires_grad_(grad_weight is not None)
        replica = DTensor.from_local(chunk_hidden, mesh, [Replicate()], run_check=False)
        logits = transform(F.linear(replica, chunk_weight).float())
        labels_replica = DTensor.from_local(labels, mesh, [Replicate()], run_check=False)
        loss = cast(DTensor, F.cross_entropy(logits, labels_replica, reduction="sum")).full_tensor()
        inputs = [t for t in (chunk_hidden, chunk_weight) if t.requires_grad]
        grads = iter(torch.autograd.grad(loss, inputs) if inputs else ())
    if grad_hidden is not None:
        grad_hidden[rows] = next(grads)
    if grad_weight is not None:
        grad_weight += next(grads)
    return loss.detach()


def chunked_causal_lm_loss(
    model: Any,
    input_ids: torch.Tensor,
    inputs: Mapping[str, Any],
    labels: torch.Tensor,
    num_items_in_batch: int,
    plan: LossPlan,
) -> torch.Tensor:
    """The model's causal-LM loss of ``labels`` (unshifted, as transformers takes them) over
    ``num_items_in_batch`` label tokens, computed in its own forward (:func:`chunked_output`)."""
    forward_inputs = {"input_ids": input_ids, **inputs}
    return cross_entropy_of(
        model, chunked_output(model, forward_inputs, shifted_labels(labels), num_items_in_batch, plan)
    )


def chunked_output(
    model: Any,
    inputs: Mapping[str, Any],
    shifted: torch.Tensor,
    num_items_in_batch: int,
    plan: LossPlan,
) -> Any:
    """The model's output for ``inputs``, its ``loss`` (:func:`cross_entropy_of`) the cross-entropy
    of the ``shifted`` labels (each position's own next token: a context-parallel part's are cut
    after the shift) over ``num_items_in_batch`` label tokens, computed by
    :func:`linear_cross_entropy_sum` (``plan``: the chunk and the family's transform) in the forward."""
    return output_with_loss(model, inputs, shifted, num_items_in_batch, planned_cross_entropy(plan))


# A loss sum of (the final hidden states, the head's weight as the strategy holds it in the forward,
# the shifted labels), computed in the model's own forward by :func:`output_with_loss`.
InForwardLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def planned_cross_entropy(plan: LossPlan) -> InForwardLoss:
    """:func:`linear_cross_entropy_sum` with the chunk and the family's transform of ``plan``."""
    transform = plan.transform or HeadTransform()

    def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy_sum(hidden, weight, labels, plan.chunk_tokens, transform)

    return cross_entropy


def output_with_loss(
    model: Any, inputs: Mapping[str, Any], shifted: torch.Tensor, num_items_in_batch: int, loss: InForwardLoss
) -> Any:
    """The model's output for ``inputs``, its ``loss`` that of ``loss`` over ``num_items_in_batch``,
    computed in the forward — in transformers' ``loss_function`` slot, the decoder's output kept by
    a hook, the head projecting only the last position — so the weight is the one the strategy
    gathers there, and its gradient goes where the strategy's hooks expect it."""
    captured: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def loss_function(logits: Any, labels: torch.Tensor, *ignored: Any, **keywords: Any) -> torch.Tensor:
        weight = model.get_output_embeddings().weight  # as the strategy holds it inside the forward
        return loss(captured["hidden"], weight, labels) / keywords["num_items_in_batch"]

    handle, own = model.get_decoder().register_forward_hook(keep), vars(model).get("_loss_function")
    model.loss_function = loss_function  # transformers' own slot for a model's loss, for this forward only
    try:
        return model(**inputs, labels=shifted, logits_to_keep=1, num_items_in_batch=num_items_in_batch)
    finally:
        handle.remove()
        if own is None:
            del model._loss_function
        else:
            model.loss_function = own


def cross_entropy_of(model: Any, output: Any) -> torch.Tensor:
    """The cross-entropy in a :func:`chunked_output`'s loss: an MoE model whose config asks for
    router logits has transformers add its load-balancing loss, of this rank's batch alone, to the
    loss it returns; it is taken back out here (its gradient cancels exactly)."""
    aux_loss = getattr(output, "aux_loss", None)
    return output.loss if aux_loss is None else output.loss - model.router_aux_loss_coef * aux_loss


def chunked_unless_built_whole(model: nn.Module, tensor_parallel_reason: str) -> LossPlan:
    """``model``'s loss plan for a loss built chunked only beside plain logits (distillation's, the
    preference objectives'): the whole logits where the plan says so, where the model adds a
    load-balancing loss (assembled beside them, as ``train_step`` does) and under tensor parallel
    (its chunks are vocabulary shards: ``tensor_parallel_reason`` says what is not built there)."""
    plan = loss_plan_of(model)
    if plan.path is LossPath.FULL:
        return plan
    if adds_router_loss(model):
        return LossPlan(LossPath.FULL, "the load-balancing loss is assembled beside the logits")
    if setup_of(model).uses_tensor_parallel:
        return LossPlan(LossPath.FULL, f"tensor parallel: {tensor_parallel_reason}")
    return plan


def loss_context(model: nn.Module) -> AbstractContextManager[None]:
    """Where the forward of a chunked loss runs: torch's vocab-parallel loss under tensor parallel
    (each chunk's loss and gradients are computed there), nothing otherwise."""
    if loss_plan_of(model).path is LossPath.CHUNKED and setup_of(model).uses_tensor_parallel:
        return loss_parallel()
    return nullcontext()
