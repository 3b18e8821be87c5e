"""The causal-LM loss from the final hidden states, a chunk of tokens at a time.

The full path computes ``lm_head`` over every token and hands the ``[tokens, vocabulary]`` logits
to the loss, which keeps them, their fp32 upcast and their gradient alive at the step's peak; for a
real vocabulary that outweighs everything else a small model's step holds. Here the head's matmul
and the cross-entropy run on ``chunk_tokens`` tokens at a time, and each chunk's gradients are
computed with its loss, so its logits are freed before the next chunk's exist: only
``[chunk_tokens, vocabulary]`` is ever alive, and no matmul is recomputed.

The loss is computed inside the model's own forward — in transformers' ``loss_function`` slot,
with the head projecting only the last position (``logits_to_keep=1``) — so the head's weight is
what the strategy makes of it there: gathered by FSDP2's root pre-forward (and gathered again for
the backward by FSDP's hooks on the forward's ``loss`` output), a replica under DDP, and under
tensor parallel the rank's vocabulary shard: the loss is then torch's vocab-parallel
cross-entropy (``loss_parallel``), each rank reducing its own slice of every chunk, no rank holding
a gathered row of logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from nemo_wrap.loading.model_state import loss_plan_of, setup_of
from nemo_wrap.loading.plan import LossPath, LossPlan
from nemo_wrap.models.head import HeadTransform
from nemo_wrap.training.token_loss import IGNORE_INDEX


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's next-token label (the last position predicts nothing), padded as
    transformers' causal-LM loss shifts them, so the hidden states are used unsliced."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def linear_cross_entropy_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, transform: HeadTransform
) -> torch.Tensor:
    """The summed cross-entropy of ``transform(hidden @ weight.T)`` against ``labels`` (already
    shifted, ``-100`` ignored), in fp32, ``chunk_tokens`` tokens at a time.

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
    backward — ``[tokens, hidden]`` and ``[vocabulary, hidden]``, never ``[tokens, vocabulary]``."""

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
        scale = float(grad_total)  # a plain scalar: it scales a vocabulary-sharded DTensor too
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden * scale
        grad_weight = None if grad_weight is None else (grad_weight * scale).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def _chunked_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    transform: HeadTransform,
    wanted: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The loss sum and, for the inputs ``wanted`` (hidden states, weight), its gradients (the
    weight's summed over the chunks in fp32, whatever the weight's dtype, as one matmul would)."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros_like(hidden) if wanted[0] else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None  # summed over chunks
    for start in range(0, labels.numel(), chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        if not bool((labels[rows] != IGNORE_INDEX).any()):  # a chunk of prompt or padding adds nothing
            continue
        with torch.enable_grad():
            chunk_hidden = hidden[rows].detach().requires_grad_(wanted[0])
            chunk_weight = weight.detach().requires_grad_(wanted[1])
            loss = _chunk_loss(chunk_hidden, chunk_weight, labels[rows], transform)
            inputs = [t for t, want in zip((chunk_hidden, chunk_weight), wanted, strict=True) if want]
            grads = iter(torch.autograd.grad(loss, inputs) if inputs else ())
            if grad_hidden is not None:
                grad_hidden[rows] = next(grads)
            if grad_weight is not None:
                grad_weight += next(grads)
        total += loss.detach()
    return total, grad_hidden, grad_weight


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, transform: HeadTransform
) -> torch.Tensor:
    if isinstance(weight, DTensor):  # a vocabulary shard: every rank holds the same hidden states
        hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False)
        labels = DTensor.from_local(labels, weight.device_mesh, [Replicate()], run_check=False)
    logits = transform(F.linear(hidden, weight).float())
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def chunked_causal_lm_loss(
    model: Any,
    input_ids: torch.Tensor,
    inputs: Mapping[str, Any],
    labels: torch.Tensor,
    num_items_in_batch: int,
    plan: LossPlan,
) -> torch.Tensor:
    """The model's causal-LM loss over ``num_items_in_batch`` label tokens, computed in its own
    forward by :func:`linear_cross_entropy_sum` (``plan``: the chunk and the family's transform)."""
    captured: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        captured["hidden"] = output[0] if isinstance(output, tuple) else output.last_hidden_state

    def loss_function(logits: Any, labels: torch.Tensor, *ignored: Any, **keywords: Any) -> torch.Tensor:
        weight = model.get_output_embeddings().weight  # as the strategy holds it inside the forward
        transform = plan.transform or HeadTransform()
        summed = linear_cross_entropy_sum(
            captured["hidden"], weight, shifted_labels(labels), plan.chunk_tokens, transform
        )
        return summed / keywords["num_items_in_batch"]

    handle, own = model.get_decoder().register_forward_hook(keep), vars(model).get("_loss_function")
    model.loss_function = loss_function  # transformers' own slot for a model's loss, for this forward only
    try:
        output = model(
            input_ids=input_ids, **inputs, labels=labels, logits_to_keep=1, num_items_in_batch=num_items_in_batch
        )
    finally:
        handle.remove()
        if own is None:
            del model._loss_function
        else:
            model.loss_function = own
    return output.loss


def loss_context(model: nn.Module) -> AbstractContextManager[None]:
    """Where the forward and backward of a chunked loss run: torch's vocab-parallel loss under
    tensor parallel (the chunks recompute their loss in the backward), nothing otherwise."""
    if loss_plan_of(model).path is LossPath.CHUNKED and setup_of(model).uses_tensor_parallel:
        return loss_parallel()
    return nullcontext()
