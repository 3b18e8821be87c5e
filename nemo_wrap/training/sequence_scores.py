"""Each sequence's completion log-probability, from the whole logits or a chunk of pairs at a time.

A preference loss reads every sequence of its batch by the sum of its completion tokens'
log-probabilities (:class:`~.preference_loss.SequenceScores`). The full path takes them from the
model's ``[sequences, tokens, vocabulary]`` logits. The chunked path — where the model's loss plan
is chunked (:mod:`.linear_loss`) — never forms those logits: in the model's own forward
(:func:`~.linear_loss.output_with_loss`, so the head's weight is what the strategy makes of it
there) it projects the completion tokens of a few *pairs* at a time, reduces them to the pairs'
scores and losses, and computes the gradients of those losses at once, its logits then freed.

Why chunks of pairs, not of tokens as the cross-entropy's: a token's gradient in a pair loss is
scaled by its pair's term, which depends on every token of both sequences of the pair. Within a
pair that is exact in one pass; across a token chunk it would need the scores first and a second
pass. So a chunk is as many whole pairs as fit ``chunk_tokens`` completion tokens (at least one),
and only ``[chunk, vocabulary]`` logits are ever alive — as with the cross-entropy, unless one
pair's completions alone exceed ``chunk_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

from nemo_wrap.loading.plan import LossPlan
from nemo_wrap.models.head import HeadTransform
from nemo_wrap.training.linear_loss import InForwardLoss, saved_gradients_scaled
from nemo_wrap.training.preference_loss import SequenceScores
from nemo_wrap.training.token_loss import IGNORE_INDEX

# Each pair's loss from the scores of a run of consecutive pairs' sequences and the index of
# the run's first sequence in the batch (where its reference log-probabilities are).
PairLosses = Callable[[SequenceScores, int], torch.Tensor]


def scores_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> SequenceScores:
    """The scores of every sequence from its whole logits (``[sequences, tokens, vocabulary]``)
    and unshifted labels, in float32: position ``i`` predicts label ``i + 1`` where it is not -100."""
    shifted = labels[:, 1:]
    learned = shifted != IGNORE_INDEX
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_log_probs = log_probs.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return SequenceScores((token_log_probs * learned).sum(-1), learned.sum(-1))


def chunked_scores_loss(
    plan: LossPlan, pair_losses: PairLosses | None, into: dict[str, SequenceScores]
) -> InForwardLoss:
    """The in-forward loss of the chunked path (module docstring): the sum of ``pair_losses``
    over every pair (zero without it: a reference's forward), each sequence's scores stored
    ``into["scores"]`` (detached)."""
    transform = plan.transform or HeadTransform()

    def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunking = (plan.chunk_tokens, transform, pair_losses, into)
        return cast(torch.Tensor, _ChunkedPairLoss.apply(hidden, weight, labels, chunking))

    return loss


class _ChunkedPairLoss(torch.autograd.Function):
    """As :mod:`.linear_loss`'s chunked cross-entropy: the gradients are computed in the forward,
    a chunk of pairs at a time, kept until the backward, which scales them."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunking: Any) -> Any:
        chunk_tokens, transform, pair_losses, into = chunking
        wanted = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])) if pair_losses else (False, False)
        gradients = (
            torch.zeros_like(hidden) if wanted[0] else None,
            torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None,
        )
        total, scores = _pair_chunks(hidden, weight, labels, (chunk_tokens, transform, pair_losses), gradients)
        into["scores"] = scores
        ctx.save_for_backward(*gradients)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return *saved_gradients_scaled(ctx, grad_total), None, None


def pair_chunks(labels: torch.Tensor, chunk_tokens: int) -> list[range]:
    """Runs of consecutive pairs (as sequence indices, two per pair) whose completion tokens fit
    ``chunk_tokens``; a pair that alone exceeds it is a run of its own."""
    per_pair = (labels != IGNORE_INDEX).sum(-1).reshape(-1, 2).sum(-1).tolist()
    runs, start, held = [], 0, 0
    for pair, tokens in enumerate(per_pair):
        if held and held + tokens > chunk_tokens:
            runs.append(range(2 * start, 2 * pair))
            start, held = pair, 0
        held += tokens
    runs.append(range(2 * start, 2 * len(per_pair)))
    return runs


def _pair_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunking: tuple[int, HeadTransform, PairLosses | None],
    gradients: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, SequenceScores]:
    """The pair losses' sum and every sequence's scores; the gradients added ``gradients``."""
    chunk_tokens, transform, pair_losses = chunking
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    parts = []
    for run in pair_chunks(labels, chunk_tokens):
        run_labels = labels[run.start : run.stop]
        rows, positions = (run_labels != IGNORE_INDEX).nonzero(as_tuple=True)
        selected = (hidden[run.start : run.stop][rows, positions], run_labels[rows, positions])
        loss, scores, grad_hidden = _run_loss(
            selected, weight, (rows, len(run)), (transform, pair_losses, run.start), gradients
        )
        total += loss
        parts.append(scores)
        if grad_hidden is not None and gradients[0] is not None:
            gradients[0][run.start : run.stop].index_put_((rows, positions), grad_hidden, accumulate=True)
    return total, SequenceScores(torch.cat([p.log_probs for p in parts]), torch.cat([p.tokens for p in parts]))


def _run_loss(
    selected: tuple[torch.Tensor, torch.Tensor],
    weight: torch.Tensor,
    rows: tuple[torch.Tensor, int],
    how: tuple[HeadTransform, PairLosses | None, int],
    gradients: tuple[torch.Tensor | None, torch.Tensor | None],
) -> tuple[torch.Tensor, SequenceScores, torch.Tensor | None]:
    """One run of pairs: the projected completion tokens' log-probabilities summed per sequence,
    the run's pair losses (their sum) and, where wanted, their gradients: the hidden rows'
    returned, the weight's added into ``gradients[1]``.

    Written out in the one ``[tokens, vocabulary]`` buffer, as the chunked cross-entropy is: the
    logits become the softmax in place, then the gradient ``c · (one-hot − softmax)``, where ``c``
    is each token's weight in the pair losses (the derivative of the losses by its
    log-probability, from autograd over the ``[tokens]`` vector alone)."""
    (hidden, targets), (row_of_token, sequences), (transform, pair_losses, first) = selected, rows, how
    buffer = F.linear(hidden, weight).float()
    slope = transform.apply_(buffer)  # the transform's derivative, where it is not the identity
    token_log_probs = _log_softmax_at_(buffer, targets)  # the buffer now holds the softmax
    with torch.enable_grad():
        leaf = token_log_probs.requires_grad_(pair_losses is not None)
        sums = leaf.new_zeros(sequences).index_add(0, row_of_token, leaf)
        scores = SequenceScores(sums, torch.bincount(row_of_token, minlength=sequences))
        loss = pair_losses(scores, first).sum() if pair_losses is not None else sums.new_zeros(())
        wanted = gradients[0] is not None or gradients[1] is not None
        (weights,) = torch.autograd.grad(loss, leaf) if wanted else (None,)
    detached = SequenceScores(sums.detach(), scores.tokens)
    if weights is None:
        return loss.detach(), detached, None
    buffer.mul_(-weights.unsqueeze(1)).scatter_add_(1, targets.unsqueeze(1), weights.unsqueeze(1))
    grad_logits = (buffer if slope is None else buffer.mul_(slope)).to(weight.dtype)
    if gradients[1] is not None and grad_logits.dtype == hidden.dtype == torch.float32:
        gradients[1].addmm_(grad_logits.T, hidden)  # in place: no second [vocabulary, hidden]
    elif gradients[1] is not None:
        gradients[1].add_((grad_logits.T @ hidden).float())
    return loss.detach(), detached, (grad_logits @ weight).to(hidden.dtype) if gradients[0] is not None else None


def _log_softmax_at_(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's log-softmax at its target, fp32 ``logits`` turned into their softmax in place."""
    target = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    top = logits.amax(dim=1, keepdim=True)
    exponentials = logits.sub_(top).exp_()
    totals = exponentials.sum(dim=1, keepdim=True)
    exponentials.div_(totals)
    return target - (top + totals.log()).squeeze(1)
