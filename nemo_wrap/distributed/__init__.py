"""Process groups, device meshes, strategies and the sharding they apply.

- :mod:`.env`: joining or creating the process group (torchrun or a notebook).
- :mod:`.collectives`: who is in a multi-rank job; failing on every rank together.
- :mod:`.strategies`: the registry of strategies (ddp, fsdp2, megatron_fsdp), one module each.
- :mod:`.setup`: ``DistributedSetup``, the validated description of a job.
- :mod:`.tensor_parallel`, :mod:`.sharding`: applying a tensor-parallel plan and a strategy.
- :mod:`.precision`: ``precision=`` ("fp32", "bf16", "bf16-mixed") as a plan per strategy.
"""

from nemo_wrap.distributed.env import DistributedEnv, destroy_distributed, initialize_distributed
from nemo_wrap.distributed.precision import PRECISIONS, Precision
from nemo_wrap.distributed.setup import DistributedSetup, Strategy

__all__ = [
    "PRECISIONS",
    "DistributedEnv",
    "DistributedSetup",
    "Precision",
    "Strategy",
    "destroy_distributed",
    "initialize_distributed",
]
