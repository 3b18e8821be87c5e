"""The dry run behind the memory prediction: one rank's real load and training step, on fake tensors.

Why traced and not a formula: a rank's peak is set by what the code allocates — FSDP's gathered
layers and what each reshard policy keeps, the tensor-parallel plan's split of every weight,
uneven shards, the chunked loss's gradients taken in the forward, which tensors each op saves for
its backward. A formula restates all of that and drifts from it; the dry run runs it. The model is
built and sharded by the load plan's own steps (:meth:`LoadPipeline.perform`, less the steps that
only fill values: the read, the init, the audit, compilation), inside torch's ``FakeTensorMode`` —
every tensor has its shape, dtype and device and no storage — on a ``fake`` process group of the
job's size in which this process plays ``rank`` (collectives return at once; torchtitan dry-runs its
jobs the same way). Then the recipes' step runs twice (the first makes AdamW's state) and torch's
``MemTracker`` records the second's peak.

What this cannot see: the allocator (fragmentation, caching, CUDA's context and workspaces) and
the memory of the communication libraries themselves; the caller states them as not counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.auto.auto_model import dry_run_pipeline
from nemo_wrap.distributed.collectives import collective_device
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.loading.model_state import HasModelState
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import Step
from nemo_wrap.loading.provenance import LoadReport
from nemo_wrap.memory.prediction import MemoryCategory, RankMemory, TrainingShape
from nemo_wrap.training.step import step_with_label_count

# What follows materializing in a plan that shards first: values written into storage that exists.
VALUE_ONLY_STEPS = frozenset({Step.READ_CHECKPOINT, Step.INITIALIZE_REST, Step.COMPILE_LAYERS, Step.AUDIT})

_CATEGORIES = {
    "Parameter": MemoryCategory.PARAMETERS,
    "Buffer": MemoryCategory.BUFFERS,
    "Gradient": MemoryCategory.GRADIENTS,
    "Optstate": MemoryCategory.OPTIMIZER_STATE,
    "Activation": MemoryCategory.ACTIVATIONS,
    "Temp": MemoryCategory.TEMPORARIES,
    "Other": MemoryCategory.OTHER,
}


def simulate_ranks(
    path_or_config: str | Path | PretrainedConfig,
    setup: DistributedSetup,
    options: LoadOptions,
    shape: TrainingShape,
    ranks: tuple[int, ...],
) -> tuple[RankMemory, ...]:
    """Each of ``ranks``' predicted peak, one dry run after another in this process (which must
    hold no process group: it creates and destroys a fake one per rank)."""
    return tuple(_simulate_rank(path_or_config, setup, options, shape, rank) for rank in ranks)


def _simulate_rank(
    path_or_config: str | Path | PretrainedConfig,
    setup: DistributedSetup,
    options: LoadOptions,
    shape: TrainingShape,
    rank: int,
) -> RankMemory:
    if setup.is_collective:
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=setup.world_size)
    try:
        pipeline = dry_run_pipeline(path_or_config, setup, options)  # config and headers: real reads
        if setup.is_collective:
            setup.device_mesh()  # built from real rank tensors, before any tensor is fake
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = pipeline.perform(_steps_before_materializing(pipeline.plan.steps))
            _materialize_fake(model)
            # the steps take the loss path from the load's report: this one says nothing was read
            cast(HasModelState, model).nemo_state.load_report = LoadReport(pipeline.plan, provenance={})
            return RankMemory(rank, *_step_peak(model, shape, setup.dp_size))
    finally:
        if setup.is_collective:
            dist.destroy_process_group()


def _step_peak(
    model: torch.nn.Module, shape: TrainingShape, dp_size: int
) -> tuple[int, tuple[tuple[MemoryCategory, int], ...]]:
    """The tensor peak of the second of two training steps, and its split by category."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = torch.zeros(shape.batch_size, shape.seq_len, dtype=torch.long)
    micro_batches = [{"input_ids": rows} for _ in range(shape.accumulation)]
    label_tokens = shape.batch_size * (shape.seq_len - 1) * shape.accumulation * dp_size
    step_with_label_count(model, optimizer, micro_batches, label_tokens, None)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step_with_label_count(model, optimizer, micro_batches, label_tokens, None)
    snapshot = max(tracker.get_tracker_snapshot("peak").values(), key=lambda device: device["Total"])
    by_kind = {getattr(key, "value", key): int(value) for key, value in snapshot.items()}
    breakdown = tuple((category, by_kind.get(kind, 0)) for kind, category in _CATEGORIES.items())
    return int(snapshot["Total"]), breakdown


def _steps_before_materializing(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """The plan's steps up to materializing, after checking that every later one only writes values
    (a plan that shards after materializing — DDP's — is refused before the dry run)."""
    position = steps.index(Step.MATERIALIZE)
    if not VALUE_ONLY_STEPS.issuperset(steps[position + 1 :]):
        raise MemoryPredictionError(f"predict_memory: no dry run for a plan that goes on after materializing: {steps}")
    return steps[:position]


def _materialize_fake(model: PreTrainedModel) -> None:
    """The plan's materialize step on fake tensors. Sharded parameters (DTensors) go through
    ``to_empty``, which swaps each in place (FSDP keeps references to them); a plain parameter or
    buffer is replaced instead, because the fake mode's weak reference to a fake tensor forbids
    swapping it. Ties are restored after, as the real step does."""
    device = collective_device()
    for module in model.modules():
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            module.to_empty(device=device, recurse=False)
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta:
                fake = torch.empty_like(parameter, device=device)
                setattr(module, name, torch.nn.Parameter(fake, requires_grad=parameter.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
    model.tie_weights()
