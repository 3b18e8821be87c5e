"""Know before launch whether a layout fits: each rank's tensor peak in a training step, predicted
by a dry run of the real load and step on fake tensors (:mod:`.dry_run`)."""

from nemo_wrap.memory.predict import predict_memory
from nemo_wrap.memory.prediction import MemoryCategory, MemoryPrediction, RankMemory, TrainingShape, parse_bytes

__all__ = ["MemoryCategory", "MemoryPrediction", "RankMemory", "TrainingShape", "parse_bytes", "predict_memory"]
