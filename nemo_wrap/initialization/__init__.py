"""Weight initialization that is correct on DTensors and independent of sharding.

- :mod:`.geometry`: where a rank's shard sits in the full tensor.
- :mod:`.tiled_random`: seeded random fills, identical under any sharding.
- :mod:`.deterministic`: constant and copy fills, shard by shard.
- :mod:`.embedding`: zeroing the padding row on the rank(s) that hold it.
- :mod:`.interception`: routing a model's init functions to those fills during a walk.
- :mod:`.ties`: restoring tied weights after initialization.
- :mod:`.mixin`: ``NeMoPreTrainedModel``, the override that owns the walk.
- :mod:`.hf_wrapping`: ``NeMo<Name>`` subclasses of transformers model classes.
"""

from nemo_wrap.initialization.embedding import zero_padding_row_
from nemo_wrap.initialization.geometry import ShardGeometry, shard_geometry
from nemo_wrap.initialization.hf_wrapping import nemo_model_class
from nemo_wrap.initialization.mixin import NeMoPreTrainedModel
from nemo_wrap.initialization.tiled_random import Normal, TruncatedNormal, Uniform, random_fill_

__all__ = [
    "NeMoPreTrainedModel",
    "Normal",
    "ShardGeometry",
    "TruncatedNormal",
    "Uniform",
    "nemo_model_class",
    "random_fill_",
    "shard_geometry",
    "zero_padding_row_",
]
