"""Context parallel: each rank of a cp group keeps a load-balanced part of every sequence.

:mod:`.sequence_split` cuts a batch into this rank's part (labels shifted first, positions kept
global) and builds the attention mask from global positions and documents; :mod:`.attention` is
the exact attention across the parts (keys and values all-gathered, gradients summed back), through
transformers' attention interface and in our fused classes.
"""

from nemo_wrap.distributed.context_parallel.attention import (
    CONTEXT_PARALLEL_ATTENTION,
    attend_across_split,
    register_context_parallel_attention,
)
from nemo_wrap.distributed.context_parallel.sequence_split import SequenceSplit, active_split

__all__ = [
    "CONTEXT_PARALLEL_ATTENTION",
    "SequenceSplit",
    "active_split",
    "attend_across_split",
    "register_context_parallel_attention",
]
