"""nemo_wrap: Hugging Face causal LMs, loaded provably and sharded for training.

The public API is what ``__all__`` lists; everything else is private.
"""

from nemo_wrap.distributed import (
    DistributedEnv,
    DistributedSetup,
    Strategy,
    destroy_distributed,
    initialize_distributed,
)
from nemo_wrap.errors import (
    DistributedStateError,
    InvalidSetupError,
    NeMoWrapError,
    StrategyUnavailableError,
)

__version__ = "0.1.0"

__all__ = [
    "DistributedEnv",
    "DistributedSetup",
    "DistributedStateError",
    "InvalidSetupError",
    "NeMoWrapError",
    "Strategy",
    "StrategyUnavailableError",
    "destroy_distributed",
    "initialize_distributed",
]
