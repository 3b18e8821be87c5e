"""The load plan: every loading decision, computed once by one pure function, printed in the audit.

The defect this replaces: a "load before shard" branch keyed on "is the model on meta?" whose
else-branch assumed the weights had come with the build, so models built on a real device under
DDP and Megatron-FSDP trained from random weights without a word. Here no branch asks the model
anything. The plan is a function of (model source, distributed setup, checkpoint present, the
load's options) only, and it is the ordered list of steps the pipeline executes — so "the checkpoint is
read exactly once, after the storage it lands in exists" is a property of the data, tested over
the whole cross product.

Every model is built on the meta device (architecture only: weights never arrive with the build,
and nothing is allocated or initialized twice). Managers that work on meta models (tensor
parallel, FSDP2) shard before materialization, so each rank allocates and reads only its shard;
the others (DDP, Megatron-FSDP) need real full weights, so each rank reads the full checkpoint
and shards afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from nemo_wrap.distributed.expert_parallel import ExpertLayout
from nemo_wrap.distributed.pipeline import StageLayout
from nemo_wrap.distributed.precision import PrecisionPlan
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.models.quantized.settings import QuantizationSettings, check_composes, quantization_settings

_DEFAULT_OPTIONS = LoadOptions()


class Step(str, Enum):
    BUILD_ON_META = "build on meta (architecture only, no weights, no init)"
    KEEP_STAGE = "keep this rank's pipeline stage (its decoder layers and ends of the model)"
    QUANTIZE_LAYERS = "swap linear layers for 4-bit ones (bitsandbytes), filled while reading"
    ADD_ADAPTERS = "add LoRA adapters and freeze the base weights"
    SHARD = "shard"
    MATERIALIZE = "materialize (allocate each rank's storage)"
    READ_CHECKPOINT = "read the checkpoint into place"
    INITIALIZE_REST = "initialize what was not read"
    COMPILE_LAYERS = "compile each decoder layer with torch.compile (it compiles at its first forward)"
    AUDIT = "audit every parameter's provenance"


@dataclass(frozen=True)
class LoadPlan:
    """What will happen, in order, and why. Pure data: printable without a process group.

    Every sentence it prints is derived from these fields.
    """

    model_class: str
    is_custom: bool
    source_reason: str
    strategy: str | None  # None: one process, no sharding
    world_size: int
    tp_size: int
    has_checkpoint: bool
    steps: tuple[Step, ...]
    key_mapping: str = "transformers' keys as they are"
    adapters: str | None = None  # None: no LoRA; "new": initialized; "file": read from an adapter directory
    precision: PrecisionPlan | None = None  # None: a plan made without one (tests of the step logic)
    mesh: str | None = None  # the setup's mesh, e.g. "dp_replicate=2, dp_shard=2, tp=2"
    parallelism: tuple[str, ...] = ()  # what each degree beyond plain data parallel does, one line each
    stages: tuple[StageLayout, ...] = ()  # pipeline stages (none without pipeline parallel)
    experts: ExpertLayout | None = None  # which experts each rank holds (None: no expert parallel)
    quantization: QuantizationSettings | None = None  # None: every weight in its dtype

    @property
    def init_device(self) -> str:
        """Where the model is built: the meta device, so no weight can arrive with the build."""
        return "meta" if self.steps[0] is Step.BUILD_ON_META else "a real device"

    @property
    def weights_arrive_with_build(self) -> bool:
        return self.init_device != "meta"

    @property
    def checkpoint_reads(self) -> int:
        return self.steps.count(Step.READ_CHECKPOINT)

    @property
    def shards_before_materializing(self) -> bool:
        return Step.SHARD in self.steps and self.steps.index(Step.SHARD) < self.steps.index(Step.MATERIALIZE)

    @property
    def read_scope(self) -> str:
        if not self.has_checkpoint:
            return "none given: nothing is read"
        stage = " of its pipeline stage's tensors" if self.stages else ""
        quantized = (
            "; each 4-bit layer's rows are quantized as they are read (no 16-bit copy of them is kept)"
            if self.quantization
            else ""
        )
        if self.shards_before_materializing:
            return f"read once, each rank reading only the slices of its own shards{stage}{quantized}"
        return f"read once, every rank reading the full tensors (they are replicated){quantized}"

    @property
    def initialize_scope(self) -> str:
        if self.has_checkpoint:
            return "only parameters the checkpoint lacks that are tied or explicitly allowed (strict=False)"
        return "every parameter and buffer (seeded, identical under any sharding)"

    @property
    def shard_reason(self) -> str:
        if self.strategy is None:
            return "none"
        if self.shards_before_materializing:
            return f"{self.strategy} shards the meta model first, so each rank allocates only its own shards"
        return f"{self.strategy} needs real full weights: shard after they are in place"

    def __str__(self) -> str:
        where = (
            "one process"
            if self.strategy is None
            else f"{self.strategy} on {self.world_size} rank(s), tp={self.tp_size}, mesh ({self.mesh})"
        )
        kind = "custom" if self.is_custom else "transformers"
        arrive = "yes" if self.weights_arrive_with_build else "no"
        lines = [
            f"load plan: {self.model_class} ({kind}: {self.source_reason}), {where}",
            f"  weights arrive with the build: {arrive} (built on {self.init_device})",
        ]
        lines += [f"  {number}. {step.value}" for number, step in enumerate(self.steps, 1)]
        lines.append(f"  checkpoint: {self.read_scope}")
        if self.has_checkpoint:
            lines.append(f"  keys: {self.key_mapping}")
        lines.append(f"  initialize: {self.initialize_scope}")
        if self.quantization is not None:
            lines.append(f"  quantization: {self.quantization}")
        if self.adapters is not None:
            how = "read from the adapter directory" if self.adapters == "file" else "new, initialized as PEFT does"
            dtype = " (float32 beside the 4-bit layers, as PEFT keeps them)" if self.quantization else ""
            lines.append(f"  LoRA adapters: {how}{dtype}; only they are trainable")
        if self.strategy is not None:
            lines.append(f"  sharding: {self.shard_reason}")
        lines += [f"  parallelism: {line}" for line in self.parallelism]
        lines += [f"  pipeline {stage.describe()}" for stage in self.stages]
        lines += [f"  experts: {line}" for line in (self.experts.describe() if self.experts else [])]
        if self.precision is not None:
            lines.append(f"  precision: {self.precision}")
        return "\n".join(lines)


def make_load_plan(
    model_class: str,
    is_custom: bool,
    source_reason: str,
    setup: DistributedSetup | None,
    has_checkpoint: bool,
    options: LoadOptions = _DEFAULT_OPTIONS,
    key_mapping: str = "transformers' keys as they are",
    precision: PrecisionPlan | None = None,
    stages: tuple[StageLayout, ...] = (),
    experts: ExpertLayout | None = None,
) -> LoadPlan:
    """The one place loading is decided. Pure: no I/O, no process group; strategy facts come from
    the strategy registry (static data). ``options`` says whether LoRA adapters are added (new or
    from a file) and whether each decoder layer is compiled once the model is complete; ``stages``
    are the pipeline stages' layouts (:func:`~nemo_wrap.distributed.pipeline.stage_layouts`),
    ``experts`` the expert-parallel layout (:func:`~nemo_wrap.distributed.expert_parallel.expert_layout`).
    """
    tp_size = 1 if setup is None else setup.tp_size
    _check_compile(options.compile, tp_size)
    quantization = None
    if options.quantization_config is not None:
        quantization = quantization_settings(options.quantization_config)
        check_composes(setup, options.precision, options.compile, has_checkpoint)
    # tensor parallel always shards the meta model (each rank reads only its slices), whatever
    # the strategy that replicates or shards the result over dp needs on its own
    shard_first = setup is not None and (setup.entry.shards_on_meta or tp_size > 1)
    steps = _ordered_steps(setup is not None, shard_first, has_checkpoint, options, bool(stages))
    return LoadPlan(
        model_class,
        is_custom,
        source_reason,
        None if setup is None else setup.strategy,
        1 if setup is None else setup.world_size,
        tp_size,
        has_checkpoint,
        steps,
        key_mapping,
        options.adapters,
        precision,
        None if setup is None else setup.mesh_summary(),
        () if setup is None else tuple(setup.describe_degrees()),
        stages,
        experts,
        quantization,
    )


def _ordered_steps(
    sharded: bool, shard_first: bool, has_checkpoint: bool, options: LoadOptions, pipelined: bool
) -> tuple[Step, ...]:
    """The steps in the order they run (see the module doc for why this order)."""
    steps = [Step.BUILD_ON_META]
    if pipelined:  # before adapters and sharding: both then see only the stage's own modules
        steps.append(Step.KEEP_STAGE)
    if options.quantization_config is not None:  # before adapters (they adapt the 4-bit layers) and sharding
        steps.append(Step.QUANTIZE_LAYERS)
    if options.adapters is not None:  # before sharding, so the adapters are sharded with their layers
        steps.append(Step.ADD_ADAPTERS)
    steps += [Step.SHARD, Step.MATERIALIZE] if shard_first else [Step.MATERIALIZE]
    if has_checkpoint:
        steps.append(Step.READ_CHECKPOINT)
    steps.append(Step.INITIALIZE_REST)
    if sharded and not shard_first:
        steps.append(Step.SHARD)
    if options.compile:
        steps.append(Step.COMPILE_LAYERS)
    steps.append(Step.AUDIT)
    return tuple(steps)


def _check_compile(compile_layers: bool, tp_size: int) -> None:
    """Compiled layers are refused with tensor parallel: on torch 2.13 a compiled layer of DTensors
    hands plain-tensor gradients to DTensor's redistribute backward, which fails (measured on gloo)."""
    if compile_layers and tp_size > 1:
        raise InvalidSetupError(
            f"compile=True with tp_size={tp_size}: compiled decoder layers do not compose with tensor "
            "parallel on this torch (DTensor's backward receives plain tensors); use compile=False or tp_size=1"
        )
