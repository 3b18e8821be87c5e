"""The parallelization strategies, one module each, registered on import.

Each module defines its options dataclass and registers one :class:`StrategyEntry`; see
:mod:`.registry` for what an entry says and README "Adding a strategy".
"""

from nemo_wrap.distributed.strategies import ddp, fsdp2, megatron_fsdp  # noqa: F401 - each registers itself
from nemo_wrap.distributed.strategies.registry import (
    StrategyEntry,
    register_strategy,
    strategy_entry,
    strategy_names,
)

__all__ = ["StrategyEntry", "register_strategy", "strategy_entry", "strategy_names"]
