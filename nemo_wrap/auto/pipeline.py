"""Executing a load plan: build on meta → shard → materialize → read → initialize the rest → audit.

:class:`LoadPipeline` runs the plan's steps in the plan's order — the order is decided once, by
:func:`nemo_wrap.loading.plan.make_load_plan`, never re-decided here from the model's state — and
holds what the steps hand to each other. Each step is one short method.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
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
)
from nemo_wrap.auto.model_mixin import no_cache_while_training
from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader
from nemo_wrap.distributed.collectives import RankGroup, collective_device, device_memory_bytes
from nemo_wrap.distributed.context_parallel import (
    CONTEXT_PARALLEL_ATTENTION,
    check_context_parallel_supported,
    register_context_parallel_attention,
)
from nemo_wrap.distributed.expert_parallel import expert_layout
from nemo_wrap.distributed.modules import decoder_layers
from nemo_wrap.distributed.pipeline.runtime import build_runtime
from nemo_wrap.distributed.pipeline.stage_model import (
    PipelineStageModule,
    check_family_pipelinable,
    has_tied_embeddings,
    held_parallel_plan,
    keep_stage_modules,
    refuse_outside_schedule,
)
from nemo_wrap.distributed.precision import apply_autocast
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.sharding import shard_model
from nemo_wrap.distributed.tensor_parallel import TensorParallelPlan, check_tensor_parallel_supported
from nemo_wrap.errors import (
    AdapterMismatchError,
    MissingWeightsError,
    NeMoWrapError,
    UnexpectedKeysError,
    UnsupportedModelError,
    summarize,
)
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import LoadPlan, Step
from nemo_wrap.loading.provenance import Initialized, LoadReport, Provenance, Tied
from nemo_wrap.loading.read import checkpoint_blocks, checkpoint_shapes, matches_any, read_into_model
from nemo_wrap.loading.verify import ChecksumsWhileReading, verify_load
from nemo_wrap.models.config_checks import (
    check_config_sizes,
    check_layer_count,
    check_size_budget,
    describe_config,
)
from nemo_wrap.models.lora import fused_parts, is_lora_parameter
from nemo_wrap.models.lora.dora import initialize_magnitudes
from nemo_wrap.models.lora.state_dict import AdapterFileAdapter, BaseWeightsAdapter
from nemo_wrap.models.quantized import check_bitsandbytes_installed, quantize_linear_layers
from nemo_wrap.models.registry import ModelSource
from nemo_wrap.state_dict import StateDictAdapter, checkpoint_tensors, encoded_weights

logger = logging.getLogger("nemo_wrap")


@dataclass
class LoadPipeline:
    """Executes a plan's steps in order; holds what the steps hand to each other."""

    plan: LoadPlan
    source: ModelSource
    config: PretrainedConfig
    dtype: torch.dtype
    setup: DistributedSetup | None
    options: LoadOptions
    checkpoint: Checkpoint | None = None
    lora: LoraRequest | None = None
    model: Any = None
    provenance: dict[str, Provenance] = field(default_factory=dict)
    used_keys: set[str] = field(default_factory=set)
    bytes_read: int = 0
    tp_plan: TensorParallelPlan | None = None
    adapter: StateDictAdapter | None = None  # built once by the read, reused by verify
    expected_checksums: dict[str, int] = field(default_factory=dict)  # verify's, taken while reading
    unused_adapter_keys: tuple[str, ...] = ()
    adapter_keys: dict[str, str] = field(default_factory=dict)  # our name → PEFT key of the adapter's tensors

    @property
    def group(self) -> RankGroup:
        """Who loads together: every rank for a sharded model, this process alone without a setup."""
        return RankGroup.of(sharded=self.setup is not None)

    def run(self) -> PreTrainedModel:
        self.check_preconditions()
        steps: dict[Step, Callable[[], None]] = {
            Step.BUILD_ON_META: self.build_on_meta,
            Step.KEEP_STAGE: self.keep_stage,
            Step.QUANTIZE_LAYERS: self.quantize_layers,
            Step.ADD_ADAPTERS: self.add_adapters,
            Step.SHARD: self.shard,
            Step.MATERIALIZE: self.materialize,
            Step.READ_CHECKPOINT: self.read_checkpoint,
            Step.INITIALIZE_REST: self.initialize_rest,
            Step.COMPILE_LAYERS: self.compile_layers,
            Step.AUDIT: self.audit,
        }
        for step in self.plan.steps:
            steps[step]()
        return self.model

    def check_preconditions(self) -> None:
        """Local checks every rank makes alike, before any allocation or collective."""
        if self.setup is not None:
            self.setup.entry.check_available()
        if self.plan.quantization is not None:
            check_bitsandbytes_installed()
        keys = None if self.checkpoint is None else checkpoint_shapes(self.checkpoint).keys()
        self.tp_plan = check_loadable(self.source, self.config, self.setup, keys)
        # a lower bound: 4-bit weights take half a byte (a model too large in 16 bits may fit in 4)
        element_size = 0.5 if self.plan.quantization else torch.empty((), dtype=self.dtype).element_size()
        shards = 1 if self.setup is None else self.setup.parameter_shards
        check_size_budget(self.config, element_size, shards, device_memory_bytes(collective_device()))

    def build_on_meta(self) -> None:
        self.model = build_on_meta(loadable_class(self.source), self.config, self.dtype)
        if self.setup is not None and self.setup.degrees.cp > 1 and not self.source.is_custom:
            register_context_parallel_attention()  # transformers' families attend through the interface
            self.model.set_attn_implementation(CONTEXT_PARALLEL_ATTENTION)
        self.model.register_forward_pre_hook(no_cache_while_training, with_kwargs=True)
        # PEFT's own adapters, added after sharding, would be neither sharded nor synced; nor can PEFT
        # wrap our 4-bit layers
        if self.setup is None and self.plan.quantization is None:
            expose_projections_to_peft(self.model, self.source)
        if self.plan.precision is not None:
            apply_autocast(self.model, self.plan.precision, collective_device().type)

    def keep_stage(self) -> None:
        """Keep this rank's stage (see :mod:`nemo_wrap.distributed.pipeline.stage_model`) and create
        the stage's groups (collective); a forward from outside the schedule is refused from now on."""
        assert self.setup is not None  # the plan keeps a stage only under pipeline parallel
        mesh = self.setup.device_mesh()
        layout = dataclasses.replace(
            self.plan.stages[self.setup.pp_rank()], tied_embeddings=has_tied_embeddings(self.model)
        )
        keep_stage_modules(self.model, layout)
        self.tp_plan = held_parallel_plan(self.model, self.tp_plan)
        stage = PipelineStageModule(self.model, layout)
        if self.plan.precision is not None:  # a stage calls its backbone alone: autocast at the stage
            apply_autocast(stage, self.plan.precision, collective_device().type)
        self.model.register_forward_pre_hook(refuse_outside_schedule(stage), with_kwargs=True)
        runtime = build_runtime(
            stage, self.setup.pipeline.schedule, mesh.mesh, mesh["pp"].get_group(), layout.tied_embeddings
        )
        self.model.nemo_state.pipeline = runtime

    def quantize_layers(self) -> None:
        assert self.plan.quantization is not None  # the plan quantizes only when asked to
        fused = fused_parts(self.model, self.source.spec.adapter(self.model))
        quantize_linear_layers(self.model, self.plan.quantization, fused, self.dtype)

    def add_adapters(self) -> None:
        assert self.lora is not None  # the plan adds adapters only when LoRA was asked for
        base_name = str(self.checkpoint.directory) if self.checkpoint is not None else ""
        self.model.nemo_state.lora_config, entries = add_adapters(self.model, self.source, self.lora, base_name)
        self.adapter_keys = adapter_keys(self.model, self.source, self.lora.config)
        if self.tp_plan is not None:  # the adapters are sharded with the plan, so they join it
            self.tp_plan = {**self.tp_plan, **entries}

    def shard(self) -> None:
        assert self.setup is not None  # the plan has a shard step only with a setup
        state = self.model.nemo_state
        stage = None if state.pipeline is None else state.pipeline.module  # the stage's FSDP root
        self.model = shard_model(
            self.model, self.setup, self.tp_plan, self.plan.precision, root=stage, experts=self.plan.experts
        )
        state.setup = self.setup

    def compile_layers(self) -> None:
        for layer in decoder_layers(self.model):
            layer.compile()  # in place, so the layer stays in the model, its hooks and its state dict

    def materialize(self) -> None:
        materialize(self.model, collective_device())

    def read_checkpoint(self) -> None:
        assert self.checkpoint is not None  # the plan reads only when there is a checkpoint
        checkpoint = self.checkpoint
        adapter = self.source.spec.adapter(self.model, checkpoint_shapes(checkpoint))
        adapter = self.adapter = adapter if self.lora is None else BaseWeightsAdapter(adapter)

        def read() -> tuple[dict[str, Provenance], set[str], int]:
            with BlockReader() as reader:
                witness = None
                if self.options.verify:
                    rereads = checkpoint_blocks(checkpoint, reader, second_read=True)
                    witness = ChecksumsWhileReading(adapter, rereads, self.same_tensors_group)
                show = self.group.is_writer
                provenance, used = read_into_model(self.model, checkpoint, reader, adapter, show, witness)
                self.expected_checksums = witness.expected if witness is not None else {}
                return provenance, used, sum(reader.bytes_read.values())

        self.provenance, self.used_keys, self.bytes_read = self.group.on_every_rank("reading the checkpoint", read)
        if encoded_weights(self.model):  # after every rank's read succeeded: it may be collective
            self.group.on_every_rank("finishing the 4-bit statistics", self.finish_encodings)
        if self.lora is not None and self.lora.adapter_file is not None:
            self.read_adapter(self.lora.adapter_file)

    def finish_encodings(self) -> None:
        for layer in encoded_weights(self.model).values():  # the same order on every rank
            layer.finish_encoding()

    def read_adapter(self, adapter_file: Checkpoint) -> None:
        show = self.group.is_writer
        provenance, used, read = self.group.on_every_rank(
            "reading the adapter", lambda: read_adapter_file(self.model, adapter_file, self.adapter_keys, show)
        )
        self.provenance.update(provenance)
        self.bytes_read += read
        self.unused_adapter_keys = tuple(sorted(set(adapter_file.entries) - used))

    def initialize_rest(self) -> None:
        loaded = _tensor_names(self.model, [n for n, p in self.provenance.items() if p.kind in ("checkpoint", "tied")])
        self.model.initialize_weights(loaded_names=loaded, seed=agree_on_seed(self.options.seed, self.setup))
        rule = f"{type(self.model).__mro__[0].__name__}._init_weights (seeded, shard-aware)"
        allowed_missing = getattr(self.model, "_keys_to_ignore_on_load_missing", None)
        distinct, tied = checkpoint_tensors(self.model)
        for target, source in tied.items():
            self.provenance.setdefault(target, Tied(source))
        if self.lora is not None and self.lora.adapter_file is None:
            new_adapter_provenance(self.provenance, list(distinct))
            initialize_magnitudes(self.model)  # DoRA: the row norms of the weights just read
        for name in distinct:
            current = self.provenance.get(name)
            if current is None:
                self.provenance[name] = Initialized(rule, "no checkpoint given")
            elif current.kind == "missing" and not self.options.strict:
                self.provenance[name] = Initialized(rule, "absent from the checkpoint, allowed by strict=False")
            elif current.kind == "missing" and matches_any(name, allowed_missing):
                why = "absent from the checkpoint, allowed by the class's _keys_to_ignore_on_load_missing"
                self.provenance[name] = Initialized(rule, why)

    @property
    def same_tensors_group(self) -> RankGroup:
        """The ranks holding the same tensor names as this one: the job, or this pipeline stage's ranks."""
        pipeline = self.model.nemo_state.pipeline
        return self.group if pipeline is None else RankGroup.of_ranks(pipeline.stage_group)

    def audit(self) -> None:
        report = LoadReport(self.plan, self.provenance, self._unexpected_keys(), self.bytes_read)
        self.model.nemo_state.load_report = report
        if self.options.verify and self.checkpoint is not None and self.adapter is not None:
            self.group.on_every_rank("verifying the load", self._verify)
            report.verified = True
        self._raise_if_incomplete(report)
        if self.group.is_writer:
            logger.info("%s", report.summary())

    def _verify(self) -> None:
        assert self.checkpoint is not None and self.adapter is not None  # audit verifies a read only
        distinct, _ = checkpoint_tensors(self.model)
        from_file = self.lora is not None and self.lora.adapter_file is not None
        in_adapter = set(self.adapter_keys) if from_file else {name for name in distinct if is_lora_parameter(name)}
        base = {name: t for name, t in distinct.items() if name not in in_adapter}
        group = self.same_tensors_group
        encoded = encoded_weights(self.model)
        verify_load(base, self.provenance, self.adapter, self.checkpoint, group, encoded, self.expected_checksums)
        if self.lora is not None and self.lora.adapter_file is not None:
            adapter = {name: t for name, t in distinct.items() if name in in_adapter}
            file_view = AdapterFileAdapter(self.adapter_keys)
            verify_load(adapter, self.provenance, file_view, self.lora.adapter_file, group)

    def _across_stages(self, names: Collection[str]) -> set[str]:
        """The union of ``names`` over every pipeline stage (this rank's alone without pipeline)."""
        if self.model.nemo_state.pipeline is None:
            return set(names)
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, sorted(names))
        return {name for part in everyone for name in part}

    def _unexpected_keys(self) -> tuple[str, ...]:
        """Checkpoint keys no rank (no pipeline stage) read."""
        if self.checkpoint is None:
            return ()
        available = set(self.checkpoint.entries) | set(self.checkpoint.pickle_tensors or {})
        ignored = getattr(self.model, "_keys_to_ignore_on_load_unexpected", None)
        used = self._across_stages(self.used_keys)
        return tuple(sorted(k for k in available - used if not matches_any(k, ignored)))

    def _raise_if_incomplete(self, report: LoadReport) -> None:
        where = self.checkpoint.directory if self.checkpoint is not None else "from_config"
        missing = sorted(self._across_stages(report.names("missing")))  # every stage raises alike
        quantized = [name for name in missing if name in encoded_weights(self.model)]
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
        if (
            self.unused_adapter_keys
            and self.options.strict
            and self.lora is not None
            and self.lora.adapter_file is not None
        ):
            raise AdapterMismatchError(
                f"{self.lora.adapter_file.directory}: {len(self.unused_adapter_keys)} adapter tensor(s) adapt nothing "
                f"in {self.plan.model_class} (pass strict=False to ignore them): {summarize(self.unused_adapter_keys)}"
            )


def check_loadable(
    source: ModelSource,
    config: PretrainedConfig,
    setup: DistributedSetup | None,
    checkpoint_keys: Collection[str] | None,
) -> TensorParallelPlan | None:
    """What a load would refuse before reading any weight, and the tensor-parallel plan it would apply.

    Pure and local: ``plan()`` runs it too, so a dry run refuses exactly what the load refuses, with
    the same error. (Whether the strategy can run on this machine is the load's check alone: a plan
    may describe a job for another machine.)
    """
    check_config_sizes(config)
    if setup is not None:
        setup.check_buildable()
    if checkpoint_keys is not None:
        check_layer_count(config, loadable_class(source), checkpoint_keys)
        source.spec.check_checkpoint_keys(source.architecture, config.model_type)
    if setup is not None and setup.degrees.pp > 1:
        check_family_pipelinable(config.model_type, source.model_class.__name__)
    if setup is not None and setup.degrees.cp > 1:
        check_context_parallel_supported(config, source.is_custom, source.model_class.__name__, setup.degrees.pp)
    experts = None if setup is None else expert_layout(config, source.model_class, setup.degrees)
    if setup is None or not setup.uses_tensor_parallel:
        return None
    plan = source.spec.parallel_plan()
    if plan is not None and experts is not None:  # experts are whole under expert parallel
        plan = experts.without_expert_entries(plan)
    check_tensor_parallel_supported(plan, config, setup.tp_size, source.model_class.__name__)
    return plan


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


def agree_on_seed(seed: int | None, setup: DistributedSetup | None) -> int:
    """An explicit seed, else rank 0's ``torch.initial_seed()`` shared with every rank.

    Unseeded processes draw different initial seeds; shards initialized from different seeds would
    not form one coherent tensor, and DDP replicas would diverge, so the default is agreed on.
    """
    if seed is not None:
        return seed
    if setup is None or not dist.is_initialized():
        return torch.initial_seed()
    agreed = [torch.initial_seed()]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]
