"""``predict_memory``: each rank's tensor peak in one training step, known before launch.

The prediction is a dry run (:mod:`.dry_run`) in a fresh process — spawned, so it works from a
notebook or a ``torchrun`` script that already holds a process group, and leaves no fake process
group or fake tensor behind in the caller. Ranks differ (the last one's shards are the smallest
when a dimension does not divide; pipeline stages hold different layers): jobs of up to
``SIMULATED_RANKS_LIMIT`` ranks simulate every rank, larger ones the first and the last.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from transformers import PretrainedConfig

from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.memory.dry_run import simulate_ranks
from nemo_wrap.memory.prediction import MemoryPrediction, TrainingShape

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
) -> MemoryPrediction:
    """Predict each rank's peak tensor bytes in a training step of ``shape`` (default
    :class:`TrainingShape`) of the model ``from_pretrained(path_or_config, distributed_setup,
    options=options)`` (or ``from_config``, given a config) would load. Reads the config and the
    checkpoint's headers, never a weight. ``device_memory`` (bytes per device) adds whether it fits.
    Raises :class:`MemoryPredictionError` for a layout the dry run cannot trace yet, naming it."""
    setup = DistributedSetup.given(distributed_setup)
    options = options or LoadOptions()
    _refuse_untraced(setup, options)
    last = setup.world_size - 1
    ranks = tuple(range(setup.world_size)) if setup.world_size <= SIMULATED_RANKS_LIMIT else (0, last)
    fresh_setup = dataclasses.replace(setup)  # without this process's mesh: it pickles
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        job = pool.submit(simulate_ranks, path_or_config, fresh_setup, options, shape or TrainingShape(), ranks)
        per_rank = job.result()
    return MemoryPrediction(shape or TrainingShape(), per_rank, device_memory, NOT_COUNTED)


def _refuse_untraced(setup: DistributedSetup, options: LoadOptions) -> None:
    """Layouts whose step cannot run on fake tensors yet, refused by name before any work."""
    degrees = setup.degrees
    untraced = {
        f"strategy {setup.strategy!r}": setup.strategy == "ddp",
        f"pipeline parallel (pp={degrees.pp})": degrees.pp > 1,
        f"context parallel (cp={degrees.cp})": degrees.cp > 1,
        f"expert parallel (ep={degrees.ep})": degrees.ep > 1,
        "4-bit quantization": options.quantization_config is not None,
    }
    refused = [name for name, applies in untraced.items() if applies]
    if refused:
        raise MemoryPredictionError(
            f"predict_memory: {', '.join(refused)} cannot be predicted yet (its step does not run on fake tensors)"
        )
