"""Process groups, device meshes and (in later modules) the sharding managers."""

from nemo_wrap.distributed.env import DistributedEnv, destroy_distributed, initialize_distributed
from nemo_wrap.distributed.setup import DistributedSetup, Strategy

__all__ = ["DistributedEnv", "DistributedSetup", "Strategy", "destroy_distributed", "initialize_distributed"]
