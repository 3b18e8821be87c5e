"""The tensor-parallel plan shared by our fused decoders (applied by ``nemo_wrap.distributed.sharding``).

Megatron-style: the fused ``qkv_proj`` and ``gate_up_proj`` are column-parallel (``Shard(0)`` of
the weight, local outputs), ``o_proj`` and ``down_proj`` row-parallel (``Shard(1)``, all-reduced
replicated outputs), the embedding vocab-parallel and ``lm_head`` column-parallel with its logits
gathered, so the loss sees whole, replicated logits. The fused layouts (:mod:`.layouts`) make each
rank's ``Shard(0)`` chunk a complete set of kv-head groups and gate/up row pairs, and the modules
read their local head counts from their local output widths, so no module needs to know ``tp``.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def decoder_tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """The plan shared by Llama, Qwen2 and Qwen3, for ``parallelize_module(model, tp_mesh, plan)``."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.*.self_attn.qkv_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
