"""The tensor-parallel plans of our fused Llama-family decoders.

Megatron-style: q/k/v and gate/up column-parallel (``Shard(0)`` of the weight, local outputs),
``o_proj`` and ``down_proj`` row-parallel (``Shard(1)``, all-reduced replicated outputs), the
embedding vocab-parallel and ``lm_head`` column-parallel with its logits gathered, so the loss
sees whole, replicated logits. In our fused classes the layouts (:mod:`.layouts`) make each rank's
``Shard(0)`` chunk of ``qkv_proj``/``gate_up_proj`` a complete set of kv-head groups and gate/up
row pairs, and the modules read their local head counts from their local output widths, so no
module needs to know ``tp``.

With sequence parallel (Megatron's, as torchtitan applies it) the residual stream between the
blocks is a ``Shard(1)`` DTensor, cut along the sequence over the tp ranks: the norms run on a
rank's own tokens, each block all-gathers its input and reduce-scatters its output instead of
all-reducing it (the same bytes on the wire), and what a checkpointed layer keeps for its
recompute is ``1/tp`` of the layer's input. The stream is cut where it enters the first layer and
made whole again before the final norm, so the embedding, the rotary positions, the masks and the
head see whole sequences exactly as without it (and inputs given as ``inputs_embeds`` are cut the
same way).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

_LAYER = "model.layers.*"

# Per-head norms (Qwen3) that act on a rank's local heads: kept whole, gradients summed over tp.
QK_NORM_MODULES = (f"{_LAYER}.self_attn.q_norm", f"{_LAYER}.self_attn.k_norm")

_SEQUENCE, _WHOLE = Shard(1), Replicate()


def _ends() -> dict[str, ParallelStyle]:
    """Vocab-parallel embedding and a column-parallel lm_head with gathered (replicated) logits."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def fused_decoder_plan() -> dict[str, ParallelStyle]:
    """Our fused Llama, Qwen2 and Qwen3 (``qkv_proj``, ``gate_up_proj``)."""
    return {
        **_ends(),
        f"{_LAYER}.self_attn.qkv_proj": ColwiseParallel(),
        f"{_LAYER}.self_attn.o_proj": RowwiseParallel(),
        f"{_LAYER}.mlp.gate_up_proj": ColwiseParallel(),
        f"{_LAYER}.mlp.down_proj": RowwiseParallel(),
    }


def _gathered_input() -> PrepareModuleInput:
    """A module that needs every token of its sequence-cut input: all-gathered, handed over local."""
    return PrepareModuleInput(input_layouts=(_SEQUENCE,), desired_input_layouts=(_WHOLE,), use_local_output=True)


def fused_decoder_sequence_parallel_plan() -> dict[str, ParallelStyle]:
    """:func:`fused_decoder_plan` with the residual stream cut along the sequence between blocks."""
    return {
        **_ends(),
        # the whole (replicated) stream is cut on entry to the first layer: a local slice, no exchange
        "model.layers.0": PrepareModuleInput(input_layouts=(_WHOLE,), desired_input_layouts=(_SEQUENCE,)),
        f"{_LAYER}.input_layernorm": SequenceParallel(),
        f"{_LAYER}.self_attn": _gathered_input(),
        f"{_LAYER}.self_attn.qkv_proj": ColwiseParallel(),
        f"{_LAYER}.self_attn.o_proj": RowwiseParallel(output_layouts=_SEQUENCE, use_local_output=False),
        f"{_LAYER}.post_attention_layernorm": SequenceParallel(),
        f"{_LAYER}.mlp": _gathered_input(),
        f"{_LAYER}.mlp.gate_up_proj": ColwiseParallel(),
        f"{_LAYER}.mlp.down_proj": RowwiseParallel(output_layouts=_SEQUENCE, use_local_output=False),
        "model.norm": _gathered_input(),
    }
