"""Expert parallel: whole experts of every MoE layer on the ranks of an expert group, tokens moved to them.

:mod:`.layout` decides (pure data, from the config and the degrees) which experts each rank holds and
refuses what cannot be split; :mod:`.sharding` applies transformers' expert-parallel layers to a
model built on meta (the strategy then FSDP-shards each run of experts over ``efsdp``).
"""

from nemo_wrap.distributed.expert_parallel.layout import ExpertLayout, expert_count, expert_layout
from nemo_wrap.distributed.expert_parallel.sharding import apply_expert_parallel

__all__ = ["ExpertLayout", "apply_expert_parallel", "expert_count", "expert_layout"]
