"""What one rank holds of a sharded model."""

from __future__ import annotations

from nemo_wrap.initialization.geometry import local_shard
from nemo_wrap.state_dict import checkpoint_tensors


def local_bytes(model) -> int:
    """Bytes of this rank's shards of the model's distinct tensors (tied ones counted once)."""
    distinct, _ = checkpoint_tensors(model)
    return sum(local_shard(t).numel() * t.element_size() for t in distinct.values())
