"""nemo_wrap: Hugging Face causal LMs, loaded provably and sharded for training.

The public API is what ``__all__`` lists; everything else is private. Names that need
transformers (the auto class, the mixin, the architecture mapping) load on first access, so
``import nemo_wrap`` stays as cheap as ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

from nemo_wrap.distributed import (
    DistributedEnv,
    DistributedSetup,
    Strategy,
    destroy_distributed,
    initialize_distributed,
)
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedStateError,
    InvalidSetupError,
    LoadVerificationError,
    MemoryPredictionError,
    MissingExtraError,
    MissingWeightsError,
    NeMoWrapError,
    PipelineUsageError,
    RemoteRankError,
    ShapeMismatchError,
    ShardingError,
    StrategyUnavailableError,
    UnexpectedKeysError,
    UnsafeCheckpointError,
    UnsupportedModelError,
    UnsupportedQuantizationError,
    UnsupportedSetupError,
)

__version__ = "0.1.0"

_LAZY = {
    "NeMoAutoModelForCausalLM": "nemo_wrap.auto",
    "NeMoPreTrainedModel": "nemo_wrap.initialization",
    "MODEL_ARCH_MAPPING": "nemo_wrap.models.registry",
    "ModelSpec": "nemo_wrap.models.spec",
    "register_architecture": "nemo_wrap.models.registry",
    "LoadOptions": "nemo_wrap.loading.options",
    "LoadPlan": "nemo_wrap.loading.plan",
    "LoadReport": "nemo_wrap.loading.provenance",
    "save_checkpoint": "nemo_wrap.checkpoint",
    "load_checkpoint": "nemo_wrap.checkpoint",
    "predict_memory": "nemo_wrap.memory",
    "TrainingShape": "nemo_wrap.memory",
    "MemoryPrediction": "nemo_wrap.memory",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nemo_wrap' has no attribute {name!r}")


__all__ = [
    "MODEL_ARCH_MAPPING",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DistributedEnv",
    "DistributedSetup",
    "DistributedStateError",
    "InvalidSetupError",
    "LoadOptions",
    "LoadPlan",
    "LoadReport",
    "LoadVerificationError",
    "MemoryPrediction",
    "MemoryPredictionError",
    "MissingExtraError",
    "MissingWeightsError",
    "ModelSpec",
    "NeMoAutoModelForCausalLM",
    "NeMoPreTrainedModel",
    "NeMoWrapError",
    "PipelineUsageError",
    "RemoteRankError",
    "ShapeMismatchError",
    "ShardingError",
    "Strategy",
    "StrategyUnavailableError",
    "TrainingShape",
    "UnexpectedKeysError",
    "UnsafeCheckpointError",
    "UnsupportedModelError",
    "UnsupportedQuantizationError",
    "UnsupportedSetupError",
    "destroy_distributed",
    "initialize_distributed",
    "load_checkpoint",
    "predict_memory",
    "register_architecture",
    "save_checkpoint",
]
