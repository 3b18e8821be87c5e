"""The tensor-parallel plan of our fused Llama-family decoders.

Megatron-style: q/k/v and gate/up column-parallel (``Shard(0)`` of the weight, local outputs),
``o_proj`` and ``down_proj`` row-parallel (``Shard(1)``, all-reduced replicated outputs), the
embedding vocab-parallel and ``lm_head`` column-parallel with its logits gathered, so the loss
sees whole, replicated logits. In our fused classes the layouts (:mod:`.layouts`) make each rank's
``Shard(0)`` chunk of ``qkv_proj``/``gate_up_proj`` a complete set of kv-head groups and gate/up
row pairs, and the modules read their local head counts from their local output widths, so no
module needs to know ``tp``.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

_LAYER = "model.layers.*"

# Per-head norms (Qwen3) that act on a rank's local heads: kept whole, gradients summed over tp.
QK_NORM_MODULES = (f"{_LAYER}.self_attn.q_norm", f"{_LAYER}.self_attn.k_norm")


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
