"""Which decoder layers, and which ends of the model, each pipeline stage holds: pure data.

Stage ``i`` of ``P`` holds a contiguous run of decoder layers (balanced by default: the first
``L mod P`` stages take one layer more); the first stage also holds the input embedding, the last
the final norm and the LM head. A model whose LM head is tied to its input embedding keeps that one
tensor on both the first and the last stage (their gradients are summed after every backward, so
the two copies stay equal, and a save writes it once).
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.vocabulary import Vocabulary


class PipelineSchedule(Vocabulary):
    """torch.distributed.pipelining's single-stage-per-rank schedules, by the names users pass."""

    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: the default, fewer micro-batches in flight
    GPIPE = "gpipe"  # ScheduleGPipe: all forwards, then all backwards


SCHEDULES = PipelineSchedule.words()
# Schedules that run several stages per rank (torch's interleaved, looped and zero-bubble ones):
# reported to hang on non-NCCL backends in torch's tracker, and not built here.
_REFUSED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class PipelineOptions:
    """``DistributedSetup.build(..., pp_schedule=..., pp_layer_split=...)``, validated.

    ``layer_split``: decoder layers per stage (e.g. ``(3, 1)``), or ``None`` for a balanced split;
    whether it covers the model's layers is checked against the config, at plan and load time.
    """

    schedule: PipelineSchedule | str = PipelineSchedule.ONE_F_ONE_B  # held as a member once built
    layer_split: tuple[int, ...] | None = None

    def check(self, pp_size: int) -> None:
        """Raise :class:`InvalidSetupError` naming ``pp_schedule`` or ``pp_layer_split``."""
        if self.schedule in _REFUSED_SCHEDULES:
            raise InvalidSetupError(
                f"DistributedSetup.build: pp_schedule={self.schedule!r} runs several stages per rank, which "
                f"is not built here (its torch schedules are reported to hang on gloo); use one of {list(SCHEDULES)}"
            )
        if self.schedule not in SCHEDULES:
            raise InvalidSetupError(
                f"DistributedSetup.build: unknown pp_schedule={self.schedule!r}; choose from {list(SCHEDULES)}"
            )
        split = self.layer_split
        if split is None:
            return
        if pp_size == 1:
            raise InvalidSetupError(f"DistributedSetup.build: pp_layer_split={list(split)} needs pp_size > 1")
        if len(split) != pp_size or not all(type(n) is int and n > 0 for n in split):
            raise InvalidSetupError(
                f"DistributedSetup.build: pp_layer_split={list(split)} must hold pp_size={pp_size} positive "
                "layer counts, one per stage"
            )


@dataclass(frozen=True)
class StageLayout:
    """What one stage holds: its index among ``stages``, its decoder layers, and the model's ends."""

    index: int
    stages: int
    layers: range
    tied_embeddings: bool

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def holds_embedding(self) -> bool:
        """The first stage embeds; the last holds the embedding too when the LM head is tied to it."""
        return self.is_first or (self.is_last and self.tied_embeddings)

    @property
    def holds_head(self) -> bool:
        """The last stage computes the head; the first holds it too when it is the tied embedding."""
        return self.is_last or (self.is_first and self.tied_embeddings)

    def describe(self) -> str:
        ends = [
            name
            for name, held in (
                ("embedding", self.holds_embedding),
                ("final norm", self.is_last),
                ("lm_head", self.holds_head),
            )
            if held
        ]
        layers = f"layers {self.layers.start}–{self.layers.stop - 1}"
        tie = " (the tied embedding ↔ lm_head, on the first and last stage)" if self.tied_embeddings and ends else ""
        return f"stage {self.index}: {layers}{' + ' + ', '.join(ends) if ends else ''}{tie}; reads only these tensors"


def stage_layouts(
    num_layers: int, stages: int, layer_split: tuple[int, ...] | None, tied_embeddings: bool
) -> tuple[StageLayout, ...]:
    """The stages' layouts for a model of ``num_layers`` decoder layers. Pure; raises
    :class:`InvalidSetupError` naming ``pp_size`` or ``pp_layer_split`` when they cannot cover it."""
    if stages > num_layers:
        raise InvalidSetupError(
            f"pp_size={stages} is larger than the model's {num_layers} decoder layers: every stage needs one"
        )
    if layer_split is None:
        base, extra = divmod(num_layers, stages)
        layer_split = tuple(base + (1 if index < extra else 0) for index in range(stages))
    elif sum(layer_split) != num_layers:
        raise InvalidSetupError(
            f"pp_layer_split={list(layer_split)} covers {sum(layer_split)} decoder layers, but the model has "
            f"{num_layers}: the counts must add up to num_hidden_layers"
        )
    starts = [sum(layer_split[:index]) for index in range(stages)]
    return tuple(
        StageLayout(index, stages, range(start, start + count), tied_embeddings)
        for index, (start, count) in enumerate(zip(starts, layer_split, strict=True))
    )
