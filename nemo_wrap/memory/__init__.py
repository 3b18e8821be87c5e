"""Know before launch whether a layout fits: each rank's tensor peak in a training step, predicted
by a dry run of the real load and step on fake tensors (:mod:`.dry_run`); and which layout to pick
(:mod:`.auto_layout`)."""

from nemo_wrap.memory.auto_layout import Candidate, LayoutChoice, Verdict, choose_layout
from nemo_wrap.memory.layouts import Layout, Machine
from nemo_wrap.memory.predict import predict_memory
from nemo_wrap.memory.prediction import MemoryCategory, MemoryPrediction, RankMemory, TrainingShape, parse_bytes

__all__ = [
    "Candidate",
    "Layout",
    "LayoutChoice",
    "Machine",
    "MemoryCategory",
    "MemoryPrediction",
    "RankMemory",
    "TrainingShape",
    "Verdict",
    "choose_layout",
    "parse_bytes",
    "predict_memory",
]
