"""Predicting a deep model from dry runs of four and of five of its layers.

Why: a dry run's time grows with the layers it traces: an 8B-shaped Llama at 8k tokens on fsdp2 × 8
takes about a second a layer, so a whole 126-layer 405B takes minutes, and ``--auto`` runs dozens
of dry runs. When every decoder layer is built alike, each adds the same bytes to any one moment
of the step (its shard of parameters and optimizer state, its gradients or what its forward
saved), and the rest (embeddings, head, loss, the gathered layer in flight) is the same at any
depth. So each moment's memory is a line in the layer count, and the peak is the highest of these
lines: the steepest one from some depth on. The forward and backward and the optimizer step each
get a line (:class:`~nemo_wrap.memory.prediction.StepPhase`) through their peaks at two depths,
``peak(L) = peak(4) + (L - 4) · (peak(5) - peak(4))``, each category of the breakdown alike, and
the highest line at full depth is the prediction. Within a phase a steeper moment can take over
later: recomputed, an 8B-shaped Llama on fsdp2 × 8 at 8k tokens peaks at the start of its
backward (every layer's saved input: 394 MB more a layer) up to 7 layers and at its end (every
layer's gradient: 436 MB a layer) from 8 on. So each line is checked at :data:`CHECK_DEPTH`
layers, and a rank whose line is below its peak there is traced whole (that model: 20.729 GiB,
where the line would have said 19.777; not recomputed, the line holds and gives 66.810 GiB, as the
whole trace). Below a few layers a third moment can hold a phase's peak (the loss's logits, the
backward of a model of two layers); measured, a phase's steepest line held from three layers on
(a 4k-vocabulary Llama on fsdp2, 128 tokens) and from four (a 30M Llama on fsdp2 with
checkpointing). Models of up to :data:`TRACED_WHOLE_UP_TO` layers are traced whole.

Layers are alike when they have one class, the same parameters and buffers (names, shapes, dtypes,
which train), and the config's per-layer lists (``layer_types``, ``no_rope_layers``, ...) hold one
value. Otherwise (a dense first layer before MoE ones, sliding windows on some layers) every layer is
traced.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.memory.prediction import RankMemory, StepPhase

SAMPLED_DEPTHS = (4, 5)
CHECK_DEPTH = 10  # where the line through the sampled depths must hold
TRACED_WHOLE_UP_TO = CHECK_DEPTH  # layers

LayerSignature = tuple[str, tuple[tuple[str, tuple[int, ...], str, bool], ...]]


@dataclass(frozen=True)
class LayerSampling:
    """Which depths the dry run traces for a model of ``layers`` decoder layers: the whole model, or
    :data:`SAMPLED_DEPTHS` and a line through them, checked at :data:`CHECK_DEPTH`."""

    layers: int
    traced_depths: tuple[int, ...]

    @property
    def extrapolates(self) -> bool:
        return self.traced_depths != (self.layers,)

    def describe(self) -> str:
        if not self.extrapolates:
            return f"traced all {self.layers} decoder layer(s)"
        low, high, check = self.traced_depths
        return (
            f"traced {low}, {high} and {check} of {self.layers} alike decoder layers, "
            f"the rest by a line through {low} and {high}, checked at {check}"
        )

    def combine(self, traced: Sequence[Mapping[StepPhase, RankMemory]]) -> RankMemory | None:
        """One rank's peak at full depth from its dry runs at :attr:`traced_depths`, in that order:
        each phase's line through the first two, and the highest. ``None`` when a phase's peak at
        the check depth is above its line: a steeper moment took over, and only the whole model's
        trace can say whether another takes over later."""
        phases = {frozenset(by_phase) for by_phase in traced}
        ranks = {rank.rank for by_phase in traced for rank in by_phase.values()}
        if len(traced) != len(self.traced_depths) or len(ranks) != 1 or len(phases) != 1:
            raise MemoryPredictionError(f"layer sampling: expected one rank's phases at depths {self.traced_depths}")
        if not self.extrapolates:
            return highest_phase(traced[0])
        low, high, checked = traced
        depths, check_depth = self.traced_depths[:2], self.traced_depths[2]
        if any(_line(low[p], high[p], depths, check_depth).peak_bytes < checked[p].peak_bytes for p in checked):
            return None
        return highest_phase({phase: _line(low[phase], high[phase], depths, self.layers) for phase in low})


def highest_phase(by_phase: Mapping[StepPhase, RankMemory]) -> RankMemory:
    """A rank's step peak: the highest of its phases' peaks."""
    return max(by_phase.values(), key=lambda rank: rank.peak_bytes)


def _line(low: RankMemory, high: RankMemory, sampled: tuple[int, ...], depth: int) -> RankMemory:
    """The line through a phase's peaks at the ``sampled`` depths, at ``depth``, each category of
    the breakdown alike."""
    low_depth, high_depth = sampled

    def at(at_low: int, at_high: int) -> int:
        return at_low + (at_high - at_low) * (depth - low_depth) // (high_depth - low_depth)

    breakdown = tuple((category, at(size, dict(high.breakdown)[category])) for category, size in low.breakdown)
    return RankMemory(low.rank, at(low.peak_bytes, high.peak_bytes), breakdown)


def sample_layers(layers: int, alike: bool) -> LayerSampling:
    """The decision: sample when the layers are alike and too many to trace in seconds."""
    if alike and layers > TRACED_WHOLE_UP_TO:
        return LayerSampling(layers, (*SAMPLED_DEPTHS, CHECK_DEPTH))
    return LayerSampling(layers, (layers,))


def layers_alike(layers: Sequence[nn.Module], config: PretrainedConfig) -> bool:
    """Whether every decoder layer of a model built on meta is built alike (see the module's doc)."""
    per_layer_lists = [value for value in vars(config).values() if _is_per_layer(value, len(layers))]
    return len({_signature(layer) for layer in layers}) == 1 and all(len(set(v)) == 1 for v in per_layer_lists)


def with_depth(config: PretrainedConfig, depth: int) -> PretrainedConfig:
    """A copy of ``config`` with ``depth`` decoder layers; its per-layer lists cut to match."""
    layers = config.num_hidden_layers
    shallow = copy.deepcopy(config)
    for name, value in vars(config).items():
        if _is_per_layer(value, layers):
            setattr(shallow, name, type(value)(value[:depth]))
    shallow.num_hidden_layers = depth
    return shallow


def _is_per_layer(value: object, layers: int) -> bool:
    return isinstance(value, list | tuple) and len(value) == layers and all(isinstance(v, str | int) for v in value)


def _signature(layer: nn.Module) -> LayerSignature:
    tensors = [*layer.named_parameters(), *layer.named_buffers()]
    described = tuple((name, tuple(t.shape), str(t.dtype), t.requires_grad) for name, t in tensors)
    return type(layer).__name__, described
