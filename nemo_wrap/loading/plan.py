"""The load plan: every loading decision, computed once by one pure function, printed in the audit.

The decision itself is :func:`nemo_wrap.loading.resolve.resolve_load_plan`; this module holds what
it decides (:class:`LoadPlan`, frozen data) and the one renderer that writes it in words.

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

from dataclasses import dataclass, field
from enum import Enum

from nemo_wrap.distributed.expert_parallel import ExpertLayout
from nemo_wrap.distributed.pipeline import StageLayout
from nemo_wrap.distributed.precision import PrecisionPlan
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.tensor_parallel import TensorParallelPlan
from nemo_wrap.models.head import HeadTransform
from nemo_wrap.models.quantized.settings import QuantizationSettings
from nemo_wrap.vocabulary import Vocabulary


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


class Adapters(str, Enum):
    """The LoRA adapters a load adds."""

    NEW = "new"  # initialized as PEFT does (peft_config)
    FILE = "file"  # read from a PEFT adapter directory (adapter)


DEFAULT_CHUNK_TOKENS = 512  # at SmolLM2's 49,152 entries: 96 MiB of fp32 logits (the full path: 768 MiB at 4k tokens)


class LossPath(Vocabulary):
    """How the training and evaluation steps compute the causal-LM loss."""

    CHUNKED = "chunked"  # the head and the cross-entropy a chunk of tokens at a time (the default)
    FULL = "full"  # the whole [tokens, vocabulary] logits, then transformers' loss


@dataclass(frozen=True)
class LossPlan:
    """The steps' loss: its path, why, and for the chunked path its chunk and the family's logit
    transform (:mod:`nemo_wrap.models.head`)."""

    path: LossPath
    reason: str
    chunk_tokens: int = 0
    transform: HeadTransform | None = None

    def describe(self) -> str:
        if self.path is LossPath.FULL:
            return f"full logits ({self.reason})"
        shown = "" if self.transform is None else self.transform.describe()
        return (
            f"chunked linear cross-entropy, {self.chunk_tokens} tokens a chunk, gradients with the loss "
            f"(never the [tokens, vocabulary] logits){shown}"
        )


@dataclass(frozen=True)
class LoadPlan:
    """What will happen, in order, and why. Pure data: printable without a process group.

    Every sentence it prints is derived from these fields (``render_plan``). ``tp_plan`` is the
    tensor-parallel plan the shard step applies (``None``: no tensor parallel); its styles compare
    by identity, so it takes no part in comparing plans (the setup and the model class decide it).
    """

    model_class: str
    is_custom: bool
    source_reason: str
    setup: DistributedSetup
    has_checkpoint: bool
    steps: tuple[Step, ...]
    precision: PrecisionPlan
    loss: LossPlan  # what train_step and evaluate compute
    key_mapping: str = "transformers' keys as they are"
    adapters: Adapters | None = None  # None: no LoRA
    stages: tuple[StageLayout, ...] = ()  # pipeline stages (none without pipeline parallel)
    experts: ExpertLayout | None = None  # which experts each rank holds (None: no expert parallel)
    quantization: QuantizationSettings | None = None  # None: every weight in its dtype
    tp_plan: TensorParallelPlan | None = field(default=None, compare=False, repr=False)

    @property
    def strategy(self) -> str:
        return self.setup.strategy

    @property
    def world_size(self) -> int:
        return self.setup.world_size

    @property
    def tp_size(self) -> int:
        return self.setup.tp_size

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
        if not self.setup.is_collective:
            return "none"
        if self.shards_before_materializing:
            return f"{self.strategy} shards the meta model first, so each rank allocates only its own shards"
        return f"{self.strategy} needs real full weights: shard after they are in place"

    def __str__(self) -> str:
        return render_plan(self)


def render_plan(plan: LoadPlan) -> str:
    """The plan in words, one fact a line: what ``print(plan)`` and the CLI's ``--plan`` show."""
    setup = plan.setup
    where = "one process"
    if setup.is_collective:
        where = f"{plan.strategy} on {plan.world_size} rank(s), tp={plan.tp_size}, mesh ({setup.mesh_summary()})"
    kind = "custom" if plan.is_custom else "transformers"
    arrive = "yes" if plan.weights_arrive_with_build else "no"
    lines = [
        f"load plan: {plan.model_class} ({kind}: {plan.source_reason}), {where}",
        f"  weights arrive with the build: {arrive} (built on {plan.init_device})",
    ]
    lines += [f"  {number}. {step.value}" for number, step in enumerate(plan.steps, 1)]
    lines.append(f"  checkpoint: {plan.read_scope}")
    if plan.has_checkpoint:
        lines.append(f"  keys: {plan.key_mapping}")
    lines.append(f"  initialize: {plan.initialize_scope}")
    if plan.quantization is not None:
        lines.append(f"  quantization: {plan.quantization}")
    if plan.adapters is not None:
        how = "read from the adapter directory" if plan.adapters is Adapters.FILE else "new, initialized as PEFT does"
        dtype = " (float32 beside the 4-bit layers, as PEFT keeps them)" if plan.quantization else ""
        lines.append(f"  LoRA adapters: {how}{dtype}; only they are trainable")
    if setup.is_collective:
        lines.append(f"  sharding: {plan.shard_reason}")
        if setup.uses_fsdp:  # what the strategy's groups hold gathered, and when: a speed-for-memory choice
            lines.append(f"  {setup.strategy} groups: {setup.options}")
        lines += [f"  parallelism: {line}" for line in setup.describe_degrees()]
    lines += [f"  pipeline {stage.describe()}" for stage in plan.stages]
    lines += [f"  experts: {line}" for line in (plan.experts.describe() if plan.experts else [])]
    lines.append(f"  precision: {plan.precision}")
    lines.append(f"  loss: {plan.loss.describe()}")
    return "\n".join(lines)
