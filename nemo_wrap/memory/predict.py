"""``predict_memory``: each rank's tensor peak in one training step, known before launch.

The prediction is a dry run (:mod:`.dry_run`) per rank, each in a fresh process: so it
works from a notebook or a ``torchrun`` script that already holds a process group, leaves no fake
process group or fake tensor behind in the caller, and no rank's groups and meshes (which torch
caches by name) meet another's. A deep model of alike layers is dry-run at two small depths, and a
1F1B pipeline step of many micro-batches at two small counts, and predicted by lines through them
(:mod:`.step_sampling`). Ranks differ (the last one's shards are the smallest when a dimension
does not divide; pipeline stages hold different layers): jobs of up to ``SIMULATED_RANKS_LIMIT``
ranks simulate every rank, larger ones the first and the last.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.distributed.degrees import ParallelDegrees
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import InvalidSetupError, MemoryPredictionError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.memory.dry_run import simulate_rank, step_sampling
from nemo_wrap.memory.prediction import MemoryPrediction, RankMemory, StepPhase, TrainingShape
from nemo_wrap.memory.step_sampling import DryRunSize, StepSampling, highest_phase

SIMULATED_RANKS_LIMIT = 8

NOT_COUNTED = (
    "the allocator's caching and fragmentation",
    "the CUDA context and library workspaces",
    "the communication libraries' own buffers",
)


def predict_memory(
    path_or_config: str | Path | PretrainedConfig,
    distributed_setup: DistributedSetup | None = None,
    shape: TrainingShape | None = None,
    options: LoadOptions | None = None,
    device_memory: int | None = None,
    *,
    ranks: Sequence[int] | None = None,
) -> MemoryPrediction:
    """Predict each rank's peak tensor bytes in a training step of ``shape`` (default
    :class:`TrainingShape`) of the model ``from_pretrained(path_or_config, distributed_setup,
    options=options)`` (or ``from_config``, given a config) would load. Reads the config and the
    checkpoint's headers, never a weight. ``device_memory`` (bytes per device) adds whether it fits.
    ``ranks`` are the ranks to dry-run (default: every rank of a job of up to
    ``SIMULATED_RANKS_LIMIT``, else the first and the last).
    Raises :class:`MemoryPredictionError` for a layout the dry run cannot trace yet, naming it.
    The ranks run in fresh processes (forked from a server), which import the caller's main
    module: a script calling this needs the usual ``if __name__ == "__main__":`` guard."""
    setup = DistributedSetup.given(distributed_setup)
    options = options or LoadOptions()
    shape = shape or TrainingShape()
    _refuse_untraced(setup, options)
    ranks = _ranks(setup.world_size) if ranks is None else tuple(ranks)
    if not ranks or any(not 0 <= rank < setup.world_size for rank in ranks):
        raise InvalidSetupError(f"predict_memory: ranks {ranks} are not ranks of a world of {setup.world_size}")
    sampling = step_sampling(path_or_config, options, setup, shape)
    # the setup copied without this process's mesh: it pickles
    job = (path_or_config, dataclasses.replace(setup), options, shape)
    per_rank, traced = _traced_ranks(job, ranks, sampling, setup.degrees)
    return MemoryPrediction(shape, per_rank, device_memory, NOT_COUNTED, traced)


def _traced_ranks(
    job: tuple[Any, ...], ranks: Sequence[int], sampling: StepSampling, degrees: ParallelDegrees
) -> tuple[tuple[RankMemory, ...], str]:
    """Each rank's peak by the dry runs ``sampling`` asks for, and how the step was covered. A
    rank whose layer line missed the check depth's peak is traced whole."""
    runs = [(rank, size) for rank in ranks for size in sampling.sizes]
    traced = dict(zip(runs, _dry_runs([_run(job, rank, size) for rank, size in runs]), strict=True))
    sampled = [
        sampling.combine({size: traced[rank, size] for size in sampling.sizes}, degrees.stage_of(rank))
        for rank in ranks
    ]
    missed = [rank for rank, memory in zip(ranks, sampled, strict=True) if memory is None]
    whole = iter(_dry_runs([_run(job, rank, sampling.whole) for rank in missed]) if missed else ())
    per_rank = tuple(memory or highest_phase(next(whole)) for memory in sampled)
    how = sampling.describe() + (f"; rank(s) {missed} missed it there, so traced whole" if missed else "")
    return per_rank, how


def _run(job: tuple[Any, ...], rank: int, size: DryRunSize) -> tuple[Any, ...]:
    """:func:`simulate_rank`'s arguments for ``rank``'s dry run of ``size``."""
    path_or_config, setup, options, shape = job
    shape = dataclasses.replace(shape, accumulation=size.micro_batches)
    return path_or_config, setup, options, shape, rank, size.layers


def _dry_runs(runs: Sequence[tuple[Any, ...]]) -> list[dict[StepPhase, RankMemory]]:
    """Each run's :func:`simulate_rank`, each in a fresh process (torch caches process groups and
    meshes by name, per process)."""
    workers = min(len(runs), os.cpu_count() or 1)
    with _fresh_processes().Pool(workers, maxtasksperchild=1) as pool:
        return pool.starmap(simulate_rank, runs)


def _fresh_processes() -> BaseContext:
    """Processes forked from a server that has imported the dry run and holds no process group (a
    fork of this process would inherit its process group; a spawned one spends seconds importing
    torch and transformers, which ``--auto`` pays per candidate). The server starts once per
    process, with the preload of whoever starts it first."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["nemo_wrap.memory.dry_run"])
    return context


def _ranks(world_size: int) -> tuple[int, ...]:
    return tuple(range(world_size)) if world_size <= SIMULATED_RANKS_LIMIT else (0, world_size - 1)


def _refuse_untraced(setup: DistributedSetup, options: LoadOptions) -> None:
    """Layouts whose step cannot run on fake tensors yet, refused by name before any work."""
    degrees, traits = setup.degrees, setup.entry.traits
    untraced = {
        "DDP with tensor parallel": Feature.REPLICATED in traits and degrees.tp > 1,
        f"strategy {setup.strategy!r} (flat parameter buffers)": Feature.FLAT_BUFFERS in traits,
    }
    refused = [name for name, applies in untraced.items() if applies]
    if refused:
        raise MemoryPredictionError(
            f"predict_memory: {', '.join(refused)} cannot be predicted yet (the dry run cannot trace its step)"
        )
