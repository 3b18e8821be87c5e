"""``choose_layout`` (``nemo-wrap plan --auto``): the cheapest layout predicted to fit.

The search is the memory prediction and the cost model put together. Every candidate
(:func:`.layouts.candidate_layouts`) is costed first, which is arithmetic; then, cheapest first,
candidates are dry-run (:func:`.predict.predict_memory`, the first and the last rank) until
``TOP`` of them fit. A candidate is not dry-run when a cheaper variant of its degrees already fits
(it could only cost more), when ``TOP`` cheaper layouts fit, or when the variants of its degrees
that hold least (:func:`_floor`) do not fit; a degree combination the setup or the dry run refuses
is refused once, with its reason, for all its variants. Fitting means the predicted peak stays
under the device memory less a ``margin`` kept for what the prediction does not count (the
allocator's caching and fragmentation, the CUDA context, the communication libraries' buffers):
10% by default. When nothing fits, the lightest variants of every degree combination have been
dry-run, and the smallest peak among them says what the job needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from transformers import PretrainedConfig

from nemo_wrap.errors import InvalidSetupError, NeMoWrapError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.memory.cost import StepCost, step_cost
from nemo_wrap.memory.dry_run import model_sizes
from nemo_wrap.memory.layouts import Degrees, Layout, Machine, candidate_layouts
from nemo_wrap.memory.predict import predict_memory
from nemo_wrap.memory.prediction import DEFAULT_MARGIN
from nemo_wrap.progress import progress_bar
from nemo_wrap.vocabulary import Vocabulary

TOP = 5
_MIB = 2**20


class Verdict(Vocabulary):
    """What became of a candidate layout."""

    FITS = "fits"
    OVER_BUDGET = "over the budget"
    REFUSED = "refused"
    COSTLIER_VARIANT = "not dry-run: a cheaper variant of its degrees fits"
    FLOOR_OVER_BUDGET = "not dry-run: the variants of its degrees that hold least do not fit"
    BEYOND_TOP = f"not dry-run: {TOP} cheaper layouts fit"


@dataclass(frozen=True)
class Candidate:
    """A layout, its cost, and what the search made of it: its predicted peak (the highest of the
    ranks dry-run) when it was dry-run, the reason when it was refused."""

    layout: Layout
    cost: StepCost
    verdict: Verdict
    peak_bytes: int | None = None
    reason: str = ""

    def describe(self) -> str:
        peak = "" if self.peak_bytes is None else f"peak {self.peak_bytes / _MIB:,.1f} MiB, "
        why = f": {self.reason}" if self.reason else ""
        return f"{self.layout.describe()}: {peak}cost {self.cost.describe()}{why}"


@dataclass(frozen=True)
class LayoutChoice:
    """The search's outcome: every candidate with its verdict, the fitting ones cheapest first."""

    machine: Machine
    margin: float
    global_batch: int
    seq_len: int
    candidates: tuple[Candidate, ...]

    @property
    def budget(self) -> int:
        """The bytes a rank's predicted peak may take: the device's memory less the margin."""
        return int(self.machine.device_memory * (1 - self.margin))

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        fits = [candidate for candidate in self.candidates if candidate.verdict is Verdict.FITS]
        return tuple(sorted(fits, key=lambda candidate: candidate.cost.seconds))

    @property
    def chosen(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    @property
    def smallest(self) -> Candidate | None:
        """The candidate with the smallest predicted peak (what the job needs at least)."""
        predicted = [candidate for candidate in self.candidates if candidate.peak_bytes is not None]
        return min(predicted, key=lambda candidate: candidate.peak_bytes or 0) if predicted else None

    def recipe_fragment(self) -> str:
        """The chosen layout as recipe YAML for ``nemo-wrap finetune --config``."""
        if self.chosen is None:
            raise InvalidSetupError("no layout fits: there is no recipe fragment to print")
        return yaml.safe_dump(self.chosen.layout.recipe(self.machine), sort_keys=False)

    def __str__(self) -> str:
        machine = self.machine
        lines = [
            f"layouts for {machine.nnodes} node(s) × {machine.nproc_per_node} rank(s), "
            f"{machine.device_memory / _MIB:,.1f} MiB per device, {self.margin:.0%} kept for what is not "
            f"counted: budget {self.budget / _MIB:,.1f} MiB per rank",
            f"the job: {self.global_batch} rows of {self.seq_len} tokens per step over all data-parallel ranks",
            "best layouts that fit, cheapest first (cost: communication and recomputation per step):",
        ]
        lines += [f"  {n}. {candidate.describe()}" for n, candidate in enumerate(self.fitting[:TOP], 1)] or ["  none"]
        lines.append("the others:")
        lines += [f"  {c.verdict}: {c.describe()}" for c in self.candidates if c.verdict is not Verdict.FITS]
        lines.append(self._conclusion())
        return "\n".join(lines)

    def _conclusion(self) -> str:
        if self.chosen is not None:
            return f"chosen, as a recipe fragment (nemo-wrap finetune --config FILE):\n{self.recipe_fragment()}"
        smallest = self.smallest
        if smallest is None or smallest.peak_bytes is None:
            return "nothing fits: every layout was refused"
        needed = smallest.peak_bytes / (1 - self.margin)
        return (
            f"nothing fits: the smallest, {smallest.layout.describe()}, needs {smallest.peak_bytes / _MIB:,.1f} MiB "
            f"per rank, {needed / _MIB:,.1f} MiB of device memory with the margin"
        )

    def as_data(self) -> dict[str, Any]:
        """JSON-ready: ``nemo-wrap plan --auto --json``'s ``"auto"``."""
        candidates = [
            {
                "layout": candidate.layout.recipe(self.machine),
                "verdict": candidate.verdict.value,
                "peak_bytes": candidate.peak_bytes,
                "cost_seconds": candidate.cost.seconds,
                "reason": candidate.reason,
            }
            for candidate in self.candidates
        ]
        chosen = None if self.chosen is None else self.chosen.layout.recipe(self.machine)
        return {"budget": self.budget, "margin": self.margin, "chosen": chosen, "candidates": candidates}


def choose_layout(
    path_or_config: str | Path | PretrainedConfig,
    machine: Machine,
    global_batch: int,
    seq_len: int,
    options: LoadOptions | None = None,
    margin: float = DEFAULT_MARGIN,
) -> LayoutChoice:
    """The cheapest layouts of ``machine`` for a job of ``global_batch`` rows of ``seq_len`` tokens
    per step whose predicted peak leaves ``margin`` of the device memory free, and why the others
    were dropped. Reads the config and the checkpoint's headers, never a weight."""
    if not 0 <= margin < 1:
        raise InvalidSetupError(f"choose_layout: margin must be in [0, 1), got {margin!r}")
    options = options or LoadOptions()
    sizes = model_sizes(path_or_config, options)
    layouts = candidate_layouts(machine, global_batch, sizes.layers, sizes.experts, sizes.sequence_parallel)
    costed = [(layout, step_cost(layout, sizes, machine, seq_len)) for layout in layouts]
    if not costed:
        raise InvalidSetupError(
            f"choose_layout: no layout of {machine.world_size} ranks shares {global_batch} rows evenly"
        )
    job = _Job(path_or_config, machine, seq_len, options, int(machine.device_memory * (1 - margin)))
    # a search of minutes at real scale: a bar over the candidates, naming the one dry-run now
    with progress_bar(len(costed), "layouts judged", speaks_for_the_job=True, unit="layout") as bar:
        search = _Search(job, [layout for layout, _ in costed], bar)
        judged = []
        for layout, cost in sorted(costed, key=lambda pair: pair[1].seconds):
            judged.append(search.judge(layout, cost))
            bar.update()
    return LayoutChoice(machine, margin, global_batch, seq_len, tuple(judged))


class _Search:
    """The search's memory: each layout's dry run (once), which degrees fit, which were refused."""

    def __init__(self, job: _Job, layouts: Sequence[Layout], bar: Any) -> None:
        self.job, self.layouts, self.bar = job, layouts, bar
        self.fitting_degrees: set[Degrees] = set()
        self.refused: dict[Degrees, str] = {}
        self.peaks: dict[Layout, int] = {}

    def judge(self, layout: Layout, cost: StepCost) -> Candidate:
        """Costed candidates come cheapest first: dry-run this one unless it cannot be among the best."""
        if layout.degrees in self.fitting_degrees:
            return Candidate(layout, cost, Verdict.COSTLIER_VARIANT)
        if len(self.fitting_degrees) >= TOP:
            return Candidate(layout, cost, Verdict.BEYOND_TOP)
        floor = _floor(layout, self.layouts)
        if not any(self._fits(smallest) for smallest in floor) and layout not in floor:
            return self._not_fitting(layout, cost)
        if not self._fits(layout):
            return self._not_fitting(layout, cost)
        self.fitting_degrees.add(layout.degrees)
        return Candidate(layout, cost, Verdict.FITS, self.peaks[layout])

    def _not_fitting(self, layout: Layout, cost: StepCost) -> Candidate:
        """Refused, over the budget as dry-run, or not dry-run because its lightest variants are over."""
        if layout.degrees in self.refused:
            return Candidate(layout, cost, Verdict.REFUSED, reason=self.refused[layout.degrees])
        if layout in self.peaks:
            return Candidate(layout, cost, Verdict.OVER_BUDGET, self.peaks[layout])
        return Candidate(layout, cost, Verdict.FLOOR_OVER_BUDGET)

    def _fits(self, layout: Layout) -> bool:
        """Whether ``layout``'s predicted peak is within the budget: dry-run once, then remembered;
        a refusal (the setup's or the dry run's) is remembered for its degrees."""
        if layout.degrees in self.refused:
            return False
        if layout not in self.peaks:
            self.bar.set_postfix_str(f"dry run of {layout.describe()}")
            try:
                self.peaks[layout] = self.job.peak(layout)
            except NeMoWrapError as error:  # the same for every variant of these degrees
                self.refused[layout.degrees] = str(error)
                return False
        return self.peaks[layout] <= self.job.budget


def _floor(layout: Layout, layouts: Sequence[Layout]) -> tuple[Layout, ...]:
    """The variants of ``layout``'s degrees that hold least: recomputed, and either one micro-batch
    a step or one row a micro-batch. Every other variant holds at least one of theirs: recomputing
    only frees, and from the second micro-batch on a step holds the accumulated gradients and one
    micro-batch's activations, which grow with its rows."""
    same = [other for other in layouts if other.degrees == layout.degrees and other.activation_checkpointing]
    return tuple(other for other in same if other.accumulation == 1 or other.micro_batch == 1)


@dataclass(frozen=True)
class _Job:
    """What every dry run of the search shares: the model, the machine, the tokens, the budget."""

    path_or_config: str | Path | PretrainedConfig
    machine: Machine
    seq_len: int
    options: LoadOptions
    budget: int

    def peak(self, layout: Layout) -> int:
        """The layout's predicted peak: the highest of its first and last rank."""
        world = self.machine.world_size
        ranks = (0, world - 1) if world > 1 else (0,)
        setup, shape = layout.setup(world), layout.shape(self.seq_len)
        return predict_memory(self.path_or_config, setup, shape, self.options, ranks=ranks).peak_bytes
