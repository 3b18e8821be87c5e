"""Executing a load plan: build on meta → shard → materialize → read → initialize the rest → audit.

:class:`LoadPipeline` runs the plan's steps in the plan's order — every decision, the order
included, is made once by :func:`nemo_wrap.loading.resolve.resolve_load_plan`, never re-decided
here from the model's state. Each step is one short method that receives the one
:class:`LoadState` the steps build up; the machine checks here only ask whether this machine can
run the plan.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.auto.classes import loadable_class
from nemo_wrap.auto.lora_steps import (
    LoraRequest,
    adapter_keys,
    add_adapters,
    expose_projections_to_peft,
    new_adapter_provenance,
    read_adapter_file,
    start_untied_copies,
)
from nemo_wrap.auto.model_mixin import no_cache_while_training
from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader
from nemo_wrap.distributed.collectives import RankGroup, collective_device, device_memory_bytes
from nemo_wrap.distributed.context_parallel import CONTEXT_PARALLEL_ATTENTION, register_context_parallel_attention
from nemo_wrap.distributed.degrees import MeshDim
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.distributed.pipeline.runtime import build_runtime
from nemo_wrap.distributed.pipeline.stage_model import (
    PipelineStageModule,
    has_tied_embeddings,
    held_parallel_plan,
    keep_stage_modules,
    refuse_outside_schedule,
)
from nemo_wrap.distributed.precision import apply_autocast
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.sharding import shard_model
from nemo_wrap.distributed.tensor_parallel import TensorParallelPlan
from nemo_wrap.errors import (
    AdapterMismatchError,
    MissingWeightsError,
    NeMoWrapError,
    UnexpectedKeysError,
    UnsupportedModelError,
    summarize,
)
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import Adapters, LoadPlan, Step
from nemo_wrap.loading.provenance import Initialized, Loaded, LoadReport, Missing, Provenance, ProvenanceKind, Tied
from nemo_wrap.loading.read import checkpoint_blocks, checkpoint_shapes, matches_any, read_into_model
from nemo_wrap.loading.verify import ChecksumsWhileReading, verify_load
from nemo_wrap.models.config_checks import check_size_budget, describe_config
from nemo_wrap.models.lora import adapter_parallel_entries, fused_parts, is_lora_parameter
from nemo_wrap.models.lora.dora import initialize_magnitudes
from nemo_wrap.models.lora.state_dict import AdapterFileAdapter, BaseWeightsAdapter
from nemo_wrap.models.quantized import QuantizationSettings, check_bitsandbytes_installed, quantize_linear_layers
from nemo_wrap.models.registry import ModelSource
from nemo_wrap.state_dict import StateDictAdapter, checkpoint_tensors, encoded_weights

logger = logging.getLogger("nemo_wrap")


@dataclass(frozen=True)
class CompletedRead:
    """One file read into the model: what verify re-reads, and what the audit checks of it."""

    checkpoint: Checkpoint
    adapter: StateDictAdapter  # between the file's keys and the model's tensors
    of_adapter_file: bool  # the LoRA adapter file (else the base checkpoint)
    expected_checksums: Mapping[str, int] = field(default_factory=dict)  # verify's, taken while reading
    unused_keys: tuple[str, ...] = ()  # an adapter file's keys that adapt nothing


@dataclass
class LoadState:
    """What the executed steps have made so far: one typed value every step receives.

    Every field is valid from the start (a step that did not run leaves it empty), so no step
    depends on another having set something.
    """

    model: Any  # the loadable class: a PreTrainedModel with ShardedModelMixin (no one type says both)
    provenance: dict[str, Provenance] = field(default_factory=dict)
    used_keys: set[str] = field(default_factory=set)
    bytes_read: int = 0
    reads: list[CompletedRead] = field(default_factory=list)
    adapter_keys: dict[str, str] = field(default_factory=dict)  # our name → PEFT key of the adapter's tensors


@dataclass(frozen=True)
class LoadPipeline:
    """Performs a plan's steps in the plan's order; decides nothing.

    ``checkpoint`` and ``lora`` are what the plan's read and adapter steps read from, opened by the
    caller (``None``: not given, and then the plan has no such step).
    """

    plan: LoadPlan
    source: ModelSource
    config: PretrainedConfig
    options: LoadOptions
    checkpoint: Checkpoint | None = None
    lora: LoraRequest | None = None

    @property
    def setup(self) -> DistributedSetup:
        return self.plan.setup

    @property
    def group(self) -> RankGroup:
        """Who loads together: every rank of a collective setup, or this process alone."""
        return self.setup.rank_group()

    def run(self) -> PreTrainedModel:
        self.check_machine()
        return self.perform(self.plan.steps)

    def perform(self, steps: Sequence[Step]) -> PreTrainedModel:
        """Build, then perform ``steps`` (the plan's, or the subset a dry run takes) in order."""
        actions = self._actions()
        state = LoadState(self.build_on_meta())
        for step in steps[1:]:  # the first is always the build
            actions[step](state)
        return state.model

    def _actions(self) -> dict[Step, Callable[[LoadState], None]]:
        """Each step's action, bound to the input it reads (a step whose input was not given has none)."""
        actions: dict[Step, Callable[[LoadState], None]] = {
            Step.KEEP_STAGE: self.keep_stage,
            Step.SHARD: self.shard,
            Step.MATERIALIZE: self.materialize,
            Step.INITIALIZE_REST: self.initialize_rest,
            Step.COMPILE_LAYERS: self.compile_layers,
            Step.AUDIT: self.audit,
        }
        if self.plan.quantization is not None:
            actions[Step.QUANTIZE_LAYERS] = partial(self.quantize_layers, self.plan.quantization)
        if self.lora is not None:
            actions[Step.ADD_ADAPTERS] = partial(self.add_adapters, self.lora)
        if self.checkpoint is not None:
            actions[Step.READ_CHECKPOINT] = partial(self.read_checkpoint, self.checkpoint)
        return actions

    def check_machine(self) -> None:
        """Whether this machine can run the plan (a plan may describe a job for another machine):
        local checks every rank makes alike, before any allocation or collective."""
        self.setup.entry.check_available()
        if self.plan.quantization is not None:
            check_bitsandbytes_installed()
        # a lower bound: 4-bit weights take half a byte (a model too large in 16 bits may fit in 4)
        dtype = self.plan.precision.parameter_dtype
        element_size = 0.5 if self.plan.quantization else torch.empty((), dtype=dtype).element_size()
        memory = device_memory_bytes(collective_device())
        check_size_budget(self.config, element_size, self.setup.parameter_shards, memory)

    def build_on_meta(self) -> PreTrainedModel:
        model = build_on_meta(loadable_class(self.source), self.config, self.plan.precision.parameter_dtype)
        if self.setup.degrees.cp > 1 and not self.source.is_custom:
            register_context_parallel_attention()  # transformers' families attend through the interface
            model.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)
        model.register_forward_pre_hook(no_cache_while_training, with_kwargs=True)
        # PEFT's own adapters, added after sharding, would be neither sharded nor synced; nor can PEFT
        # wrap our 4-bit layers
        if not self.setup.is_collective and self.plan.quantization is None:
            expose_projections_to_peft(model, self.source)
        apply_autocast(model, self.plan.precision, collective_device().type)
        return model

    def keep_stage(self, state: LoadState) -> None:
        """Keep this rank's stage (see :mod:`nemo_wrap.distributed.pipeline.stage_model`) and create
        the stage's groups (collective); a forward from outside the schedule is refused from now on."""
        model, mesh = state.model, self.setup.device_mesh()
        layout = dataclasses.replace(self.plan.stages[self.setup.pp_rank()], tied_embeddings=has_tied_embeddings(model))
        keep_stage_modules(model, layout)
        stage = PipelineStageModule(model, layout)
        apply_autocast(stage, self.plan.precision, collective_device().type)  # a stage calls its backbone alone
        model.register_forward_pre_hook(refuse_outside_schedule(stage), with_kwargs=True)
        pp_group, schedule = mesh[MeshDim.PP].get_group(), self.setup.pipeline.schedule
        model.nemo_state.pipeline = build_runtime(stage, schedule, mesh.mesh, pp_group, layout.tied_embeddings)

    def quantize_layers(self, settings: QuantizationSettings, state: LoadState) -> None:
        fused = fused_parts(state.model, self.source.spec.adapter(state.model))
        quantize_linear_layers(state.model, settings, fused, self.plan.precision.parameter_dtype)

    def add_adapters(self, lora: LoraRequest, state: LoadState) -> None:
        base_name = str(self.checkpoint.directory) if self.checkpoint is not None else ""
        state.model.nemo_state.lora_config = add_adapters(state.model, self.source, lora, base_name)
        state.adapter_keys = adapter_keys(state.model, self.source, lora.config)

    def shard(self, state: LoadState) -> None:
        model_state = state.model.nemo_state
        stage = None if model_state.pipeline is None else model_state.pipeline.module  # the stage's FSDP root
        tp_plan = self._tensor_parallel_plan(state.model)
        state.model = shard_model(
            state.model, self.setup, tp_plan, self.plan.precision, root=stage, experts=self.plan.experts
        )
        model_state.setup = self.setup

    def _tensor_parallel_plan(self, model: PreTrainedModel) -> TensorParallelPlan | None:
        """The plan's, less the modules another pipeline stage holds, plus the LoRA adapters'
        entries (adapters are sharded with their layers)."""
        plan = self.plan.tp_plan
        if plan is None:
            return None
        held = held_parallel_plan(model, plan) if self.plan.stages else plan
        return {**(held or {}), **adapter_parallel_entries(model)}

    def compile_layers(self, state: LoadState) -> None:
        for layer in decoder_layers(state.model):
            layer.compile()  # in place, so the layer stays in the model, its hooks and its state dict

    def materialize(self, state: LoadState) -> None:
        materialize(state.model, collective_device())

    def read_checkpoint(self, checkpoint: Checkpoint, state: LoadState) -> None:
        model = state.model
        adapter = self.source.spec.adapter(model, checkpoint_shapes(checkpoint))
        adapter = adapter if self.lora is None else BaseWeightsAdapter(adapter, model.nemo_state.untied)
        same_tensors = self.same_tensors_group(model)

        def read() -> tuple[dict[str, Provenance], set[str], int, dict[str, int]]:
            with BlockReader() as reader:
                witness = None
                if self.options.verify:
                    rereads = checkpoint_blocks(checkpoint, reader, second_read=True)
                    witness = ChecksumsWhileReading(adapter, rereads, same_tensors)
                provenance, used = read_into_model(model, checkpoint, reader, adapter, self.group.is_writer, witness)
                expected = witness.expected if witness is not None else {}
                return provenance, used, sum(reader.bytes_read.values()), expected

        provenance, state.used_keys, state.bytes_read, expected = self.group.on_every_rank(
            "reading the checkpoint", read
        )
        state.provenance.update(provenance)
        state.reads.append(CompletedRead(checkpoint, adapter, of_adapter_file=False, expected_checksums=expected))
        if encoded_weights(model):  # after every rank's read succeeded: it may be collective
            self.group.on_every_rank("finishing the 4-bit statistics", lambda: finish_encodings(model))
        if self.lora is not None and self.lora.adapter_file is not None:
            self.read_adapter(self.lora.adapter_file, state)

    def read_adapter(self, adapter_file: Checkpoint, state: LoadState) -> None:
        show, keys = self.group.is_writer, state.adapter_keys
        provenance, used, read = self.group.on_every_rank(
            "reading the adapter", lambda: read_adapter_file(state.model, adapter_file, keys, show)
        )
        state.provenance.update(provenance)
        state.bytes_read += read
        unused = tuple(sorted(set(adapter_file.entries) - used))
        state.reads.append(CompletedRead(adapter_file, AdapterFileAdapter(keys), True, unused_keys=unused))

    def initialize_rest(self, state: LoadState) -> None:
        model, provenance = state.model, state.provenance
        loaded = _tensor_names(model, [n for n, p in provenance.items() if isinstance(p, (Loaded, Tied))])
        model.initialize_weights(loaded_names=loaded, seed=agree_on_seed(self.options.seed, self.setup))
        start_untied_copies(model, provenance, loaded)
        rule = f"{type(model).__mro__[0].__name__}._init_weights (seeded, shard-aware)"
        allowed_missing = getattr(model, "_keys_to_ignore_on_load_missing", None)
        distinct, tied = checkpoint_tensors(model)
        for target, source in tied.items():
            provenance.setdefault(target, Tied(source))
        if self.plan.adapters is Adapters.NEW:
            new_adapter_provenance(provenance, list(distinct))
            initialize_magnitudes(model)  # DoRA: the row norms of the weights just read
        for name in distinct:
            current = provenance.get(name)
            if current is None:
                provenance[name] = Initialized(rule, "no checkpoint given")
            elif isinstance(current, Missing) and not self.options.strict:
                provenance[name] = Initialized(rule, "absent from the checkpoint, allowed by strict=False")
            elif isinstance(current, Missing) and matches_any(name, allowed_missing):
                why = "absent from the checkpoint, allowed by the class's _keys_to_ignore_on_load_missing"
                provenance[name] = Initialized(rule, why)

    def same_tensors_group(self, model: Any) -> RankGroup:
        """The ranks holding the same tensor names as this one: the job, or this pipeline stage's ranks."""
        pipeline = model.nemo_state.pipeline
        return self.group if pipeline is None else RankGroup.of_ranks(pipeline.stage_group)

    def audit(self, state: LoadState) -> None:
        report = LoadReport(self.plan, state.provenance, self._unexpected_keys(state), state.bytes_read)
        state.model.nemo_state.load_report = report
        if self.options.verify and state.reads:
            self.group.on_every_rank("verifying the load", lambda: self._verify(state))
            report.verified = True
        self._raise_if_incomplete(report, state)
        if self.group.is_writer:
            logger.info("%s", report.summary())

    def _verify(self, state: LoadState) -> None:
        """Each read's tensors against its file: the adapter file's are its keys', the base's the rest."""
        model = state.model
        distinct, _ = checkpoint_tensors(model)
        from_file = any(read.of_adapter_file for read in state.reads)
        in_adapter = set(state.adapter_keys) if from_file else {name for name in distinct if is_lora_parameter(name)}
        group = self.same_tensors_group(model)
        for read in state.reads:
            tensors = {name: t for name, t in distinct.items() if (name in in_adapter) == read.of_adapter_file}
            encoded = {} if read.of_adapter_file else encoded_weights(model)
            verify_load(
                tensors, state.provenance, read.adapter, read.checkpoint, group, encoded, read.expected_checksums
            )

    def _unexpected_keys(self, state: LoadState) -> tuple[str, ...]:
        """Base-checkpoint keys no rank (no pipeline stage) read."""
        if self.checkpoint is None:
            return ()
        available = set(self.checkpoint.entries) | set(self.checkpoint.pickle_tensors or {})
        ignored = getattr(state.model, "_keys_to_ignore_on_load_unexpected", None)
        used = _across_stages(state.model, state.used_keys)
        return tuple(sorted(k for k in available - used if not matches_any(k, ignored)))

    def _raise_if_incomplete(self, report: LoadReport, state: LoadState) -> None:
        where = self.checkpoint.directory if self.checkpoint is not None else "from_config"
        missing = sorted(_across_stages(state.model, report.names(ProvenanceKind.MISSING)))  # every stage raises alike
        quantized = [name for name in missing if name in encoded_weights(state.model)]
        if quantized:
            raise MissingWeightsError(
                f"{where}: {len(quantized)} weight(s) of 4-bit layers are not in the checkpoint, and a 4-bit layer "
                f"is quantized from its checkpoint tensor, never initialized (keep such layers unquantized with "
                f"llm_int8_skip_modules): {summarize(quantized)}"
            )
        if missing:
            raise MissingWeightsError(
                f"{where}: {len(missing)} parameter(s) are neither in the checkpoint nor "
                f"tied or allowed to be initialized (pass strict=False to initialize them): {summarize(missing)}"
            )
        if report.unexpected_keys and self.options.strict:
            raise UnexpectedKeysError(
                f"{where}: {len(report.unexpected_keys)} checkpoint tensor(s) fill no parameter of "
                f"{self.plan.model_class} (pass strict=False to ignore them): {summarize(report.unexpected_keys)}"
            )
        for read in state.reads:
            if read.unused_keys and self.options.strict:
                raise AdapterMismatchError(
                    f"{read.checkpoint.directory}: {len(read.unused_keys)} adapter tensor(s) adapt nothing in "
                    f"{self.plan.model_class} (pass strict=False to ignore them): {summarize(read.unused_keys)}"
                )


def finish_encodings(model: PreTrainedModel) -> None:
    """Let every 4-bit layer finish its statistics (collective where they span ranks)."""
    for layer in encoded_weights(model).values():  # the same order on every rank
        layer.finish_encoding()


def _across_stages(model: Any, names: Collection[str]) -> set[str]:
    """The union of ``names`` over every pipeline stage (this rank's alone without pipeline)."""
    if model.nemo_state.pipeline is None:
        return set(names)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, sorted(names))
    return {name for part in everyone for name in part}


def _tensor_names(model: PreTrainedModel, names: list[str]) -> set[str]:
    """``names`` as the model's own tensors: a 4-bit layer's weight is its encoding tensors."""
    encoded = encoded_weights(model)
    tensors = {name for name in names if name not in encoded}
    for name in set(names) & set(encoded):
        tensors.update(f"{name.removesuffix('weight')}{tensor}" for tensor in encoded[name].encoding)
    return tensors


def build_on_meta(model_class: type[PreTrainedModel], config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """Architecture only: no memory, no init (transformers skips init on the meta device)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(config)
    except NeMoWrapError:
        raise
    except Exception as error:  # on meta, nothing but the config can fail: an activation name, a rope type, …
        raise UnsupportedModelError(
            f"{describe_config(config)}: {model_class.__name__} cannot be built from this config "
            f"({type(error).__name__}: {str(error)[:200]})"
        ) from error
    finally:
        torch.set_default_dtype(previous)
    model.config.dtype = dtype
    return model


def materialize(model: PreTrainedModel, device: torch.device) -> None:
    """Allocate (uninitialized) storage for every shard, then restore ties that ``to_empty`` broke."""
    model.to_empty(device=device)
    model.tie_weights()


def agree_on_seed(seed: int | None, setup: DistributedSetup) -> int:
    """An explicit seed, else rank 0's ``torch.initial_seed()`` shared with every rank.

    Unseeded processes draw different initial seeds; shards initialized from different seeds would
    not form one coherent tensor, and DDP replicas would diverge, so the default is agreed on.
    """
    if seed is not None:
        return seed
    if not setup.rank_group().collective:
        return torch.initial_seed()
    agreed = [torch.initial_seed()]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]
