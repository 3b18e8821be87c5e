"""Exact attention across a context-parallel group, on gloo/CPU and on CUDA alike.

Each rank's keys and values are all-gathered over the cp group (the Llama 3 paper's choice: cheap
with grouped-query attention, whose keys and values are a fraction of the queries), and each rank's
queries attend all of them through SDPA with the split's mask (global causal order, documents,
sliding window). The backward of the gather sums every rank's gradient for a key and keeps this
rank's part (an all-reduce, which gloo has; NCCL's reduce-scatter would do the same with less
traffic). torch's ring attention (``context_parallel``) intercepts only the flash, memory-efficient
and cuDNN kernels, none of which runs on a CPU.

transformers' families reach this through their attention interface: a load with ``cp_size > 1``
sets the model's implementation to :data:`CONTEXT_PARALLEL_ATTENTION`, registered (with the
masks of ``"sdpa"`` outside a cut, none under one) the first time such a load happens. Outside
an active split the function is transformers' SDPA attention, so the model still runs whole
(``generate``, one-process evaluation).
Our fused classes call :func:`attend_across_split` themselves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from nemo_wrap.distributed.context_parallel.sequence_split import SequenceSplit, active_split
from nemo_wrap.errors import UnsupportedModelError

CONTEXT_PARALLEL_ATTENTION = "nemo_context_parallel"


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (2 of ``[rows, heads, seq, head_dim]``), rank by rank;
    backward: the sum of every rank's gradient, this rank's part of it."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), local.shape[2]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = gradient.contiguous()
        dist.all_reduce(summed, group=ctx.group)
        return summed[:, :, ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length], None


class _PrefixThenCausal(torch.autograd.Function):
    """CPU attention of a query chunk (global indices ``[prefix, prefix + m)``) over keys ``[0, prefix + m)``
    in sequence order, without a mask: the prefix fully, the chunk's own keys causally, the two
    merged by their log-sum-exps — and in backward each block's gradients from the merged output
    and log-sum-exp (as ring attention does). torch's CPU flash kernel returns the log-sum-exp."""

    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prefix: int, scale: float | None
    ) -> torch.Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(query, key[:, :, prefix:], value[:, :, prefix:], 0.0, True, scale=scale)
        if prefix:
            before, lse_before = flash(query, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scale)
            merged = torch.logaddexp(lse_before, lse)
            out = before * torch.exp(lse_before - merged)[..., None] + out * torch.exp(lse - merged)[..., None]
            out, lse = out.to(query.dtype), merged
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        prefix, gradient = ctx.prefix, gradient.contiguous()
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        d_query, d_key, d_value = backward(
            gradient, query, key[:, :, prefix:], value[:, :, prefix:], out, lse, 0.0, True, scale=ctx.scale
        )
        if prefix:
            d_query_before, d_key_before, d_value_before = backward(
                gradient, query, key[:, :, :prefix], value[:, :, :prefix], out, lse, 0.0, False, scale=ctx.scale
            )
            d_query = d_query + d_query_before
            d_key, d_value = torch.cat([d_key_before, d_key], 2), torch.cat([d_value_before, d_value], 2)
        return d_query, d_key, d_value, None, None


def _chunk_attention(
    split: SequenceSplit,
    chunk: int,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None,
    dropout: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query chunk over the keys (sequence order) up to its last token."""
    part, visible = split.query_chunks()[chunk]
    chunk_query, keys, values = query[:, :, part], keys[:, :, :visible], values[:, :, :visible]
    if split.is_plain(sliding_window) and dropout == 0.0 and query.device.type == "cpu":  # no mask at all
        groups = query.shape[1] // keys.shape[1]
        keys, values = (t.repeat_interleave(groups, dim=1).to(query.dtype) for t in (keys, values))  # one dtype
        return _PrefixThenCausal.apply(chunk_query, keys, values, visible - chunk_query.shape[2], scale)
    return F.scaled_dot_product_attention(
        chunk_query,
        keys,
        values,
        attn_mask=split.chunk_mask(chunk, sliding_window).to(query.device),
        dropout_p=dropout,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
    )


def attend_across_split(
    split: SequenceSplit,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``[rows, heads, L/C, head_dim]`` attention of this rank's queries over every rank's keys.

    The gathered keys are put back in sequence order, and each of the rank's two query chunks
    attends only the keys up to its last token: the early chunk sees a short prefix. A row of one
    document with every key valid and no window needs no mask (on the CPU, :class:`_PrefixThenCausal`);
    otherwise the mask is one chunk's queries by the keys it can see.
    """
    assert split.group is not None  # only a split of a real cp group (SequenceSplit.of) is made active
    split.count_attention_call()
    order = split.key_order.to(key.device)
    keys = _GatherSequence.apply(key, split.group).index_select(2, order)
    values = _GatherSequence.apply(value, split.group).index_select(2, order)
    outputs = [
        _chunk_attention(split, chunk, query, keys, values, scale, dropout, sliding_window) for chunk in range(2)
    ]
    return torch.cat(outputs, dim=2)


def context_parallel_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; transformers' SDPA outside an active split.

    Under a split the mask transformers built (for this rank's part alone) is replaced by the
    split's; what SDPA cannot express here is refused by name rather than computed wrongly.
    """
    split = active_split()
    if split is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__}: attention with logit soft-capping or a position bias cannot run "
            "under context parallel"
        )
    output = attend_across_split(split, query, key, value, scaling, dropout, kwargs.get("sliding_window"))
    return output.transpose(1, 2).contiguous(), None


def register_context_parallel_attention() -> None:
    """Register :func:`context_parallel_attention` under :data:`CONTEXT_PARALLEL_ATTENTION` in
    transformers' attention interface, with the ``"sdpa"`` mask builder (idempotent)."""
    AttentionInterface.register(CONTEXT_PARALLEL_ATTENTION, context_parallel_attention)
    AttentionMaskInterface.register(CONTEXT_PARALLEL_ATTENTION, _context_parallel_mask)


def _context_parallel_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask outside a cut; none under one — the split makes its own, and a mask
    for this rank's part alone (its positions jump between chunks, which reads as packed rows) would
    cost ``(L/C)²`` for nothing."""
    return None if active_split() is not None else sdpa_mask(*args, **kwargs)
