"""Predicting a deep model from dry runs of four and of five of its layers.

Why: a dry run's time grows with the layers it traces (FSDP's gathered layers are real, see
:mod:`.dry_run`): an 8B-shaped Llama at 8k tokens on fsdp2 × 8 takes 24 s plus 3 s a layer, so a
whole 126-layer 405B takes many minutes, and ``--auto`` runs dozens of dry runs. When every decoder
layer is built alike, each adds the same bytes to any one moment of the step (its shard of
parameters and optimizer state, its gradients or what its forward saved), and the rest
(embeddings, head, loss, the gathered layer in flight) is the same at any depth. So each moment's
memory is a line in the layer count, and the peak is the highest of these lines: the steepest one
from some depth on. Two depths past that point give it: ``peak(L) = peak(4) + (L - 4) · (peak(5) -
peak(4))``, each category of the breakdown alike. Below that point another moment holds the peak
(the loss's logits, or the backward of a model of two layers) and a line through it would
underestimate; measured, the steepest line held from three layers on (a 4k-vocabulary Llama on
fsdp2, 128 tokens), from four (a 30M Llama on fsdp2 with checkpointing) and from one (an 8B-shaped
Llama on fsdp2 × 8 at 8k tokens: 9.372, 9.740, 10.107, 10.474 GiB for one to four layers; sampled
20.756 GiB at 32 layers, in 47 s, as the whole trace, in 119 s). Models of up to
:data:`TRACED_WHOLE_UP_TO` layers, which trace in seconds, are traced whole.

Layers are alike when they have one class, the same parameters and buffers (names, shapes, dtypes,
which train), and the config's per-layer lists (``layer_types``, ``no_rope_layers``, ...) hold one
value. Otherwise (a dense first layer before MoE ones, sliding windows on some layers) every layer is
traced.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.memory.prediction import RankMemory

SAMPLED_DEPTHS = (4, 5)
TRACED_WHOLE_UP_TO = 8  # layers

LayerSignature = tuple[str, tuple[tuple[str, tuple[int, ...], str, bool], ...]]


@dataclass(frozen=True)
class LayerSampling:
    """Which depths the dry run traces for a model of ``layers`` decoder layers: the whole model, or
    :data:`SAMPLED_DEPTHS` and a line through them."""

    layers: int
    traced_depths: tuple[int, ...]

    @property
    def extrapolates(self) -> bool:
        return self.traced_depths != (self.layers,)

    def describe(self) -> str:
        if not self.extrapolates:
            return f"traced all {self.layers} decoder layer(s)"
        depths = " and ".join(str(depth) for depth in self.traced_depths)
        return f"traced {depths} of {self.layers} alike decoder layers, the rest by a line through them"

    def combine(self, traced: Sequence[RankMemory]) -> RankMemory:
        """One rank's peak at full depth from its dry runs at :attr:`traced_depths`, in that order."""
        if len(traced) != len(self.traced_depths) or len({rank.rank for rank in traced}) != 1:
            raise MemoryPredictionError(f"layer sampling: expected one rank at depths {self.traced_depths}")
        if not self.extrapolates:
            return traced[0]
        first, second = traced
        (low, high), extra = self.traced_depths, self.layers - self.traced_depths[0]

        def at_full_depth(at_low: int, at_high: int) -> int:
            return at_low + (at_high - at_low) * extra // (high - low)

        breakdown = tuple(
            (category, at_full_depth(size, dict(second.breakdown)[category])) for category, size in first.breakdown
        )
        return RankMemory(first.rank, at_full_depth(first.peak_bytes, second.peak_bytes), breakdown)


def sample_layers(layers: int, alike: bool) -> LayerSampling:
    """The decision: sample when the layers are alike and too many to trace in seconds."""
    if alike and layers > TRACED_WHOLE_UP_TO:
        return LayerSampling(layers, SAMPLED_DEPTHS)
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
