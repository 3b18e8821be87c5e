"""Predicting a large step from dry runs of smaller ones: fewer decoder layers, fewer micro-batches.

Why: a dry run's time grows with the layers and the micro-batches it traces: an 8B-shaped Llama at
8k tokens on fsdp2 × 8 takes about a second a layer, a pipeline stage about a quarter of a second
a layer and micro-batch, so a whole 126-layer 405B takes minutes, and ``--auto`` runs dozens of
dry runs.

Layers. When every decoder layer is built alike, each adds the same bytes to any one moment of the
step (its shard of parameters and optimizer state, its gradients or what its forward saved), and
the rest (embeddings, head, loss, the gathered layer in flight) is the same at any depth. So each
moment's memory is a line in the layer count, and the peak is the highest of these lines: the
steepest one from some depth on. The forward and backward and the optimizer step each get a line
(:class:`~nemo_wrap.memory.prediction.StepPhase`) through their peaks at two depths one layer
apart, ``peak(L) = peak(4) + (L - 4) · (peak(5) - peak(4))``, each category of the breakdown
alike, and the highest line at full depth is the prediction. Within a phase a steeper moment can
take over later: recomputed, an 8B-shaped Llama on fsdp2 × 8 at 8k tokens peaks at the start of
its backward (every layer's saved input: 394 MB more a layer) up to 7 layers and at its end (every
layer's gradient: 436 MB a layer) from 8 on. So each line is checked at :data:`CHECK_DEPTH`
layers, and a rank whose line is below its peak there is traced whole (that model: 20.729 GiB,
where the line would have said 19.777; not recomputed, the line holds and gives 66.810 GiB, as the
whole trace). Below a few layers a third moment can hold a phase's peak (the loss's logits, the
backward of a model of two layers); measured, a phase's steepest line held from three layers on
(a 4k-vocabulary Llama on fsdp2, 128 tokens) and from four (a 30M Llama on fsdp2 with
checkpointing). Sampling traces 4 + 5 + 10 layers, so it serves models (or pipeline stages) of
more than :data:`TRACED_WHOLE_UP_TO`. In a pipeline the depth is per stage: the model is built
with the same number of layers in every stage, and each rank's line is taken at its own stage's
layer count.

Layers are alike when they have one class, the same parameters and buffers (names, shapes, dtypes,
which train), and the config's per-layer lists (``layer_types``, ``no_rope_layers``, ...) hold one
value. Otherwise (a dense first layer before MoE ones, sliding windows on some layers) every layer is
traced.

Micro-batches. Under 1F1B, stage ``s`` of ``P`` keeps at most ``P - s`` micro-batches in flight,
however many the step runs. From ``P + 1`` on, every moment of the schedule occurs (the first
stage's forward after a backward), and each further micro-batch adds only what torch's schedule
keeps per micro-batch for the whole step (its receive buffers, its rows of the stacked inputs and
labels): the same bytes at every moment and at every depth. So a step of more than ``P + 2``
micro-batches is predicted by a line through ``P + 1`` and ``P + 2``, taken at one layer per stage
when the layers are alike. Measured on an 8B-shaped Llama at 8k tokens, recomputed, traced whole:
pp 2 at 4 micro-batches and pp 4 at 6 and 9 are the line's values to the byte on the first stage
and within 4 bytes on the last. GPipe keeps every micro-batch in flight until the backwards, and is
traced with all of them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig

from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.memory.prediction import RankMemory, StepPhase

SAMPLED_DEPTHS = (4, 5)  # one layer apart: the line's slope is their difference
CHECK_DEPTH = 10  # where the line through the sampled depths must hold
TRACED_WHOLE_UP_TO = sum(SAMPLED_DEPTHS) + CHECK_DEPTH  # layers (per stage): below, sampling costs more
SLOPE_DEPTH = 1  # layers per stage where the micro-batch line is taken (it does not depend on them)

LayerSignature = tuple[str, tuple[tuple[str, tuple[int, ...], str, bool], ...]]
ByPhase = Mapping[StepPhase, RankMemory]


@dataclass(frozen=True)
class DryRunSize:
    """What one dry run builds and steps: ``layers`` decoder layers in all (the model's own count:
    the whole model, split over the pipeline stages as it is; fewer: as many in every stage) and
    ``micro_batches`` per step."""

    layers: int
    micro_batches: int


@dataclass(frozen=True)
class StepSampling:
    """Which dry runs stand for the step of a model whose pipeline stages hold ``stage_layers``
    decoder layers (one entry without a pipeline) over ``micro_batches``, and how their peaks
    combine into each rank's (see the module's doc)."""

    stage_layers: tuple[int, ...]
    micro_batches: int
    alike: bool
    samples_layers: bool
    samples_micro_batches: bool

    @property
    def whole(self) -> DryRunSize:
        return DryRunSize(sum(self.stage_layers), self.micro_batches)

    @property
    def traced_micro_batches(self) -> int:
        """The micro-batches of the runs the layer line goes through."""
        return len(self.stage_layers) + 1 if self.samples_micro_batches else self.micro_batches

    @property
    def sizes(self) -> tuple[DryRunSize, ...]:
        """Every dry run to make, each once."""
        return tuple(dict.fromkeys((*self._layer_sizes, *self._micro_batch_sizes)))

    def _cut(self, per_stage: int) -> int:
        return per_stage * len(self.stage_layers)

    @property
    def _layer_sizes(self) -> tuple[DryRunSize, ...]:
        """Depths 4, 5 and 10 a stage, or the whole model; at :attr:`traced_micro_batches`."""
        batches = self.traced_micro_batches
        if not self.samples_layers:
            return (DryRunSize(self.whole.layers, batches),)
        return tuple(DryRunSize(self._cut(depth), batches) for depth in (*SAMPLED_DEPTHS, CHECK_DEPTH))

    @property
    def _micro_batch_sizes(self) -> tuple[DryRunSize, ...]:
        """The two runs the micro-batch line goes through (none when all are traced)."""
        if not self.samples_micro_batches:
            return ()
        layers = self._cut(SLOPE_DEPTH) if self.alike else self.whole.layers
        batches = self.traced_micro_batches
        return DryRunSize(layers, batches), DryRunSize(layers, batches + 1)

    def describe(self) -> str:
        """How the dry runs cover the step, as the plan prints it."""
        stage = " a stage" if len(self.stage_layers) > 1 else ""
        if self.samples_layers:
            low, high = SAMPLED_DEPTHS
            layers = (
                f"traced {low}, {high} and {CHECK_DEPTH}{stage} of {max(self.stage_layers)} alike decoder layers, "
                f"the rest by a line through {low} and {high}, checked at {CHECK_DEPTH}"
            )
        else:
            split = f" ({', '.join(map(str, self.stage_layers))} by stage)" if stage else ""
            layers = f"traced all {self.whole.layers} decoder layer(s){split}"
        if not self.samples_micro_batches:
            return layers
        low_batches = self.traced_micro_batches
        return (
            f"{layers}; {low_batches} and {low_batches + 1} of {self.micro_batches} micro-batches (1F1B), "
            "the rest by a line through them"
        )

    def combine(self, traced: Mapping[DryRunSize, ByPhase], stage: int) -> RankMemory | None:
        """One rank's peak from its dry runs at :attr:`sizes`: each phase's layer line at its
        stage's depth, plus the micro-batch line's growth, and the highest phase. ``None`` when a
        phase's peak at the check depth is above its line: a steeper moment took over, and only
        the whole step's trace can say whether another takes over later."""
        if set(traced) != set(self.sizes) or len({frozenset(by_phase) for by_phase in traced.values()}) != 1:
            raise MemoryPredictionError(f"step sampling: expected one rank's phases at {self.sizes}")
        at_depth = self._layer_line(traced, self.stage_layers[stage])
        if at_depth is None:
            return None
        if self.samples_micro_batches:
            low, high = (traced[size] for size in self._micro_batch_sizes)
            more = self.micro_batches - self.traced_micro_batches
            at_depth = {phase: _along(memory, low[phase], high[phase], more) for phase, memory in at_depth.items()}
        return highest_phase(at_depth)

    def _layer_line(self, traced: Mapping[DryRunSize, ByPhase], depth: int) -> ByPhase | None:
        if not self.samples_layers:
            return traced[self._layer_sizes[0]]
        low, high, checked = (traced[size] for size in self._layer_sizes)

        def line(phase: StepPhase, at: int) -> RankMemory:
            return _along(low[phase], low[phase], high[phase], at - SAMPLED_DEPTHS[0])

        if any(line(phase, CHECK_DEPTH).peak_bytes < checked[phase].peak_bytes for phase in low):
            return None
        return {phase: line(phase, depth) for phase in low}


def highest_phase(by_phase: ByPhase) -> RankMemory:
    """A rank's step peak: the highest of its phases' peaks."""
    return max(by_phase.values(), key=lambda rank: rank.peak_bytes)


def _along(base: RankMemory, low: RankMemory, high: RankMemory, steps: int) -> RankMemory:
    """``base`` plus ``steps`` times the growth from ``low`` to ``high``, each category alike."""
    lows, highs = dict(low.breakdown), dict(high.breakdown)
    grown = ((category, size + steps * (highs[category] - lows[category])) for category, size in base.breakdown)
    breakdown = tuple(grown)
    return RankMemory(base.rank, base.peak_bytes + steps * (high.peak_bytes - low.peak_bytes), breakdown)


def sample_step(stage_layers: Sequence[int], micro_batches: int, alike: bool, one_f_one_b: bool) -> StepSampling:
    """The decision: sample the layers when they are alike and every stage holds more than
    :data:`TRACED_WHOLE_UP_TO`; sample the micro-batches of a 1F1B pipeline of ``P`` stages when
    there are more than ``P + 2``."""
    stages = tuple(stage_layers)
    samples_layers = alike and min(stages) > TRACED_WHOLE_UP_TO
    samples_micro_batches = one_f_one_b and len(stages) > 1 and micro_batches > len(stages) + 2
    return StepSampling(stages, micro_batches, alike, samples_layers, samples_micro_batches)


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
