"""The dry run behind the memory prediction: one rank's real load and training step, on fake tensors.

Why traced and not a formula: a rank's peak is set by what the code allocates — FSDP's gathered
layers and what each reshard policy keeps, the tensor-parallel plan's split of every weight,
uneven shards, the chunked loss's gradients taken in the forward, which tensors each op saves for
its backward, which attention kernel runs. A formula restates all of that and drifts from it; the
dry run runs it. On a ``fake`` process group of the job's size in which this process plays
``rank`` (collectives return at once; torchtitan dry-runs its jobs the same way), the load plan's
own steps build and shard the model on the meta device (:meth:`LoadPipeline.perform`, up to
materializing: the steps after it only write values). Its storage is then made of torch's fake
tensors — shape, dtype and device, no bytes — and the recipes' step runs twice on it (the first
makes AdamW's state) while torch's ``MemTracker`` records the second's peak. The step runs outside
the fake mode: what it computes from fake tensors is fake, what it makes from sizes alone is real
unless it is large (:mod:`.fake_allocations`: FSDP's gathered layers and buffers, AdamW's state).
So its inputs, positions and labels are real (a few bytes) and the step takes the paths a real one
takes (inside the mode transformers takes fake positions for a trace and builds the full attention
mask a real step skips: +25% at 4k tokens, +50% at 8k). On 42 of the 48 configurations of
``benchmarks/bench_memory.py`` the prediction equals the measured peak on every rank (the others:
expert parallel, whose real router is uneven, and the first stage of two pipelines).

What this cannot see: the allocator (fragmentation, caching, CUDA's context and workspaces) and
the memory of the communication libraries themselves; the caller states them as not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.auto.auto_model import dry_run_pipeline
from nemo_wrap.auto.pipeline import LoadPipeline
from nemo_wrap.distributed.collectives import collective_device
from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.distributed.expert_parallel import ExpertLayout
from nemo_wrap.distributed.expert_parallel.layout import applicable_expert_plan, expert_count
from nemo_wrap.distributed.expert_parallel.sharding import experts_modules
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.distributed.pipeline.layout import PipelineSchedule, stage_layouts
from nemo_wrap.distributed.pipeline.stage_model import has_tied_embeddings
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import MemoryPredictionError
from nemo_wrap.loading.model_state import HasModelState, pipeline_of
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import Step
from nemo_wrap.loading.provenance import LoadReport
from nemo_wrap.memory.balanced_routing import balanced_routing
from nemo_wrap.memory.cost import ModelSizes
from nemo_wrap.memory.fake_allocations import LargeAllocationsFake
from nemo_wrap.memory.fake_kernels import GroupedMatmulInAnyFloat
from nemo_wrap.memory.pipeline_stages import ReceivesDeliverOnes, declared_stage_tensors
from nemo_wrap.memory.prediction import MemoryCategory, RankMemory, StepPhase, TrainingShape
from nemo_wrap.memory.step_sampling import StepSampling, layers_alike, sample_step, with_depth
from nemo_wrap.memory.tracking import second_step_peaks_by_phase
from nemo_wrap.training.step import step_with_label_count

# What follows materializing in a plan that shards first: values written into storage that exists.
VALUE_ONLY_STEPS = frozenset({Step.READ_CHECKPOINT, Step.INITIALIZE_REST, Step.COMPILE_LAYERS, Step.AUDIT})

# a phase's peak bytes, and their split by category
_Peak = tuple[int, tuple[tuple[MemoryCategory, int], ...]]

_CATEGORIES = {
    "Parameter": MemoryCategory.PARAMETERS,
    "Buffer": MemoryCategory.BUFFERS,
    "Gradient": MemoryCategory.GRADIENTS,
    "Optstate": MemoryCategory.OPTIMIZER_STATE,
    "Activation": MemoryCategory.ACTIVATIONS,
    "Temp": MemoryCategory.TEMPORARIES,
    "Other": MemoryCategory.OTHER,
}


def simulate_rank(
    path_or_config: str | Path | PretrainedConfig,
    setup: DistributedSetup,
    options: LoadOptions,
    shape: TrainingShape,
    rank: int,
    depth: int,
) -> dict[StepPhase, RankMemory]:
    """The predicted peaks of ``rank``, of each phase of the step, for the model cut to ``depth``
    decoder layers (as many in every pipeline stage; see :mod:`.step_sampling`), by a dry run in
    this process, which must hold no process group (it creates a fake one, and destroys it). DDP's
    replica is traced as one process (torch's ``replicate`` reads storage as it wraps, and fake
    tensors have none), plus the gradient buckets its reducer allocates once and keeps: as large as
    the trainable parameters (measured: the whole difference between a DDP rank's peak and one
    process's)."""
    replicated = Feature.REPLICATED in setup.entry.traits
    traced = DistributedSetup.single_process() if replicated else setup
    if traced.is_collective:
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=traced.world_size)
    try:
        with warnings.catch_warnings():  # torch's warnings about the dry run's own use of FSDP and meshes
            warnings.simplefilter("ignore")
            model, by_phase = _dry_run(path_or_config, traced, options, shape, setup.dp_size, depth)
    finally:
        if traced.is_collective:
            dist.destroy_process_group()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if replicated else 0
    return {
        phase: RankMemory(rank, peak + buckets, (*breakdown, (MemoryCategory.GRADIENT_BUCKETS, buckets)))
        for phase, (peak, breakdown) in by_phase.items()
    }


def _dry_run(
    path_or_config: str | Path | PretrainedConfig,
    setup: DistributedSetup,
    options: LoadOptions,
    shape: TrainingShape,
    dp_size: int,
    depth: int,
) -> tuple[PreTrainedModel, dict[StepPhase, _Peak]]:
    """The model cut to ``depth`` layers, built, sharded and materialized on fake tensors, and its
    step's peaks. The plan is the full model's: only what is built is cut (its decoder layers and,
    in a pipeline, each stage's share of them)."""
    pipeline = _cut(dry_run_pipeline(path_or_config, setup, options), depth)  # config and headers: real reads
    # on the meta device, as in a real load; meshes and groups are made of real rank tensors
    model = pipeline.perform(_steps_before_materializing(pipeline.plan.steps))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        _materialize_fake(model)
    # the steps take the loss path from the load's report: this one says nothing was read
    cast(HasModelState, model).nemo_state.load_report = LoadReport(pipeline.plan, provenance={})
    # outside the mode, what the step creates from real inputs stays real (positions, labels):
    # transformers takes a fake position for tracing and would build masks the real step skips
    with _data_independent_step(model, pipeline):
        return model, _step_peaks(model, shape, dp_size, fake_mode)


def _cut(pipeline: LoadPipeline, depth: int) -> LoadPipeline:
    """``pipeline`` building ``depth`` decoder layers, as many in every pipeline stage (or the whole
    model, split as it is, when ``depth`` is its own count)."""
    if depth == pipeline.config.num_hidden_layers:
        return pipeline
    plan = pipeline.plan
    if plan.stages:
        if depth % len(plan.stages):
            raise MemoryPredictionError(f"predict_memory: {depth} layers do not fill {len(plan.stages)} stages alike")
        tied = plan.stages[0].tied_embeddings
        plan = dataclasses.replace(plan, stages=stage_layouts(depth, len(plan.stages), None, tied))
    return dataclasses.replace(pipeline, plan=plan, config=with_depth(pipeline.config, depth))


@contextlib.contextmanager
def _data_independent_step(model: PreTrainedModel, pipeline: LoadPipeline) -> Iterator[None]:
    """Where a step reads values, which fake tensors do not have, fixed ones instead: experts
    routed evenly (expert parallel); the tensors between pipeline stages declared, and every
    receive delivering ones (pipeline parallel)."""
    with contextlib.ExitStack() as stack:
        if pipeline.plan.experts is not None:
            stack.enter_context(balanced_routing(model, pipeline.plan.experts))
        state = cast(HasModelState, model).nemo_state
        if state.pipeline is not None:
            plan = pipeline.plan
            declared = declared_stage_tensors(pipeline.config, plan.precision, plan.loss.path)
            state.pipeline = dataclasses.replace(state.pipeline, declared=declared)
            stack.enter_context(ReceivesDeliverOnes())
        yield


def _step_peaks(
    model: PreTrainedModel, shape: TrainingShape, dp_size: int, fake_mode: FakeTensorMode
) -> dict[StepPhase, _Peak]:
    """The tensor peak of each phase of the second of two training steps, and its split by category."""
    model.train()
    if shape.activation_checkpointing:
        model.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = torch.zeros(shape.batch_size, shape.seq_len, dtype=torch.long)
    # from the second micro-batch on, each holds what the second holds (the gradients accumulated
    # so far, one micro-batch's activations): two stand for any number, except in a pipeline,
    # whose schedule keeps several in flight
    count = shape.accumulation if pipeline_of(model) is not None else min(shape.accumulation, 2)
    micro_batches = [{"input_ids": rows} for _ in range(count)]
    label_tokens = shape.batch_size * (shape.seq_len - 1) * shape.accumulation * dp_size
    with GroupedMatmulInAnyFloat(), LargeAllocationsFake(fake_mode):  # outside the tracker (see the modules)
        by_phase = second_step_peaks_by_phase(
            model,
            optimizer,
            micro_batches,
            lambda batches: step_with_label_count(model, optimizer, batches, label_tokens, None),
        )
    return {
        phase: (by_kind["Total"], tuple((category, by_kind.get(kind, 0)) for kind, category in _CATEGORIES.items()))
        for phase, by_kind in by_phase.items()
    }


def step_sampling(
    path_or_config: str | Path | PretrainedConfig, options: LoadOptions, setup: DistributedSetup, shape: TrainingShape
) -> StepSampling:
    """Which dry runs stand for the step (:mod:`.step_sampling`), decided on the model as one
    process builds it on meta and on the stages the setup splits it into."""
    model = _model_on_meta(path_or_config, options)
    config = model.config
    stages: tuple[int, ...] = (config.num_hidden_layers,)
    if setup.degrees.pp > 1:
        tied = has_tied_embeddings(model)
        layouts = stage_layouts(config.num_hidden_layers, setup.degrees.pp, setup.pipeline.layer_split, tied)
        stages = tuple(len(layout.layers) for layout in layouts)
    one_f_one_b = setup.pipeline.schedule is PipelineSchedule.ONE_F_ONE_B
    return sample_step(stages, shape.accumulation, layers_alike(decoder_layers(model), config), one_f_one_b)


def model_sizes(path_or_config: str | Path | PretrainedConfig, options: LoadOptions) -> ModelSizes:
    """The sizes the cost model charges for, from the model as one process builds it on meta."""
    pipeline = dry_run_pipeline(path_or_config, DistributedSetup.single_process(), options)
    model = pipeline.perform(_steps_before_materializing(pipeline.plan.steps))
    parameters = list(model.parameters())
    config = model.config
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    experts = _experts_modules(model)
    expert_parameters = [p for module in experts for p in module.parameters()]
    return ModelSizes(
        parameters=sum(p.numel() for p in parameters),
        parameter_bytes=_bytes(parameters),
        trainable_bytes=_bytes(p for p in parameters if p.requires_grad),
        hidden_size=config.hidden_size,
        kv_size=(getattr(config, "num_key_value_heads", None) or heads) * head_size,
        layers=config.num_hidden_layers,
        activation_bytes=max(p.element_size() for p in parameters if p.is_floating_point()),
        experts=expert_count(config) if experts else 0,
        experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
        moe_layers=len(experts),
        expert_bytes=_bytes(expert_parameters),
        expert_trainable_bytes=_bytes(p for p in expert_parameters if p.requires_grad),
        sequence_parallel=pipeline.source.spec.sequence_parallel_plan is not None,
    )


def _experts_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The modules expert parallel would dispatch tokens to (none for a dense model, or a family
    transformers declares no expert-parallel plan for)."""
    plan = applicable_expert_plan(type(model))
    count = expert_count(model.config)
    if not count or plan is None:
        return []
    return experts_modules(model, ExpertLayout(count, 1, 1, tuple(plan.items())))


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _model_on_meta(path_or_config: str | Path | PretrainedConfig, options: LoadOptions) -> PreTrainedModel:
    """The model one process would load with ``options`` (its adapters and precision included), on
    the meta device: no storage, no process group."""
    pipeline = dry_run_pipeline(path_or_config, DistributedSetup.single_process(), options)
    return pipeline.perform(_steps_before_materializing(pipeline.plan.steps))


def _steps_before_materializing(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """The plan's steps up to materializing, after checking that every later one only writes values
    (DDP's plan shards after materializing: :func:`simulate_rank` traces its replica instead)."""
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
