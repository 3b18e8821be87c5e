"""What the memory prediction says: each rank's peak tensor bytes in a training step, and of what.

Pure data, printable and serializable: :func:`nemo_wrap.memory.predict_memory` fills it from a dry
run (:mod:`.dry_run`); ``nemo-wrap plan`` prints it after the load plan, or as JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.vocabulary import Vocabulary

_MIB = 2**20
# The share of a device's memory a layout search keeps free for what a prediction does not count
# (the allocator's caching and fragmentation, the CUDA context, the communication buffers).
DEFAULT_MARGIN = 0.10
_UNITS = {"B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class MemoryCategory(Vocabulary):
    """What the bytes at the peak hold: torch's ``MemTracker`` categories, named for a reader."""

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"  # saved for the backward, and the forward's outputs
    TEMPORARIES = "temporaries"  # the backward's working tensors: activation gradients, gathered weights
    GRADIENT_BUCKETS = "gradient_buckets"  # DDP's reducer: kept from the first step on
    OTHER = "other"


class StepPhase(Vocabulary):
    """The two parts of a training step whose peaks grow differently with the model's depth."""

    FORWARD_BACKWARD = "forward and backward"  # every micro-batch's
    OPTIMIZER_STEP = "optimizer step"


@dataclass(frozen=True)
class TrainingShape:
    """The step a prediction is for: rows per rank per micro-batch, tokens per row, micro-batches
    per optimizer step (the recipe's ``training.batch_size``, its sequence length and
    ``training.accumulation``), and whether each decoder layer recomputes its activations in the
    backward (``model.activation_checkpointing_enable()``). The optimizer is the recipes' AdamW over
    the trainable parameters."""

    batch_size: int = 8
    seq_len: int = 512
    accumulation: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "accumulation"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidSetupError(f"TrainingShape: {name} must be a positive integer, got {value!r}")

    def describe(self) -> str:
        recomputed = ", activations recomputed per layer" if self.activation_checkpointing else ""
        rows = f"{self.batch_size} row(s) × {self.seq_len} tokens a micro-batch"
        return f"{rows}, {self.accumulation} a step{recomputed}, AdamW"


@dataclass(frozen=True)
class RankMemory:
    """One rank's predicted peak: total tensor bytes and their split by category at that moment."""

    rank: int
    peak_bytes: int
    breakdown: tuple[tuple[MemoryCategory, int], ...]

    def describe(self) -> str:
        parts = ", ".join(f"{category.value} {size / _MIB:,.1f}" for category, size in self.breakdown if size)
        return f"rank {self.rank}: {self.peak_bytes / _MIB:,.1f} MiB ({parts})"


@dataclass(frozen=True)
class MemoryPrediction:
    """Every simulated rank's peak in one training step of ``shape``. Jobs of more than
    ``SIMULATED_RANKS_LIMIT`` ranks list the first and the last rank only (see :mod:`nemo_wrap.memory.predict`)."""

    shape: TrainingShape
    per_rank: tuple[RankMemory, ...]
    device_memory: int | None = None  # bytes per device, when asked whether it fits
    not_counted: tuple[str, ...] = ()
    traced: str = ""  # how the dry runs covered the step (:mod:`.step_sampling`)

    @property
    def peak_bytes(self) -> int:
        return max(rank.peak_bytes for rank in self.per_rank)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory is None else self.peak_bytes <= self.device_memory

    def __str__(self) -> str:
        lines = [f"memory per rank (predicted tensor peak, one training step: {self.shape.describe()}):"]
        if self.traced:
            lines.append(f"  dry run: {self.traced}")
        lines += [f"  {rank.describe()}" for rank in self.per_rank]
        if self.device_memory is not None:
            margin = (self.device_memory - self.peak_bytes) / _MIB
            verdict = f"fits, {margin:,.1f} MiB to spare" if margin >= 0 else f"does not fit: {-margin:,.1f} MiB over"
            lines.append(f"  device memory {self.device_memory / _MIB:,.1f} MiB: {verdict}")
        lines.append(f"  not counted: {'; '.join(self.not_counted)}")
        return "\n".join(lines)

    def as_data(self) -> dict[str, Any]:
        """The prediction as JSON-ready data (``nemo-wrap plan --json``'s ``"memory"``)."""
        per_rank = [
            {"rank": r.rank, "peak_bytes": r.peak_bytes, "breakdown": {c.value: n for c, n in r.breakdown}}
            for r in self.per_rank
        ]
        shape = dataclasses.asdict(self.shape)
        return {
            "per_rank": per_rank,
            "shape": shape,
            "device_memory": self.device_memory,
            "fits": self.fits,
            "traced": self.traced,
        }


def parse_bytes(text: str, argument: str = "device memory") -> int:
    """``"80GiB"``, ``"512 MiB"``, ``"2e9"`` → bytes; an unreadable size names ``argument``."""
    cleaned = text.strip().upper().replace(" ", "")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if cleaned.endswith(u)), "")
    number = cleaned[: len(cleaned) - len(unit)] if unit else cleaned
    try:
        value = float(number) * _UNITS[unit or "B"]
    except ValueError:
        raise InvalidSetupError(f"{argument}: {text!r} is no size (e.g. 80GiB, 512MiB, 2e9)") from None
    if value <= 0:
        raise InvalidSetupError(f"{argument}: {text!r} must be positive")
    return int(value)
