"""The load plan: every loading decision, computed once by one pure function, printed in the audit.

The defect this replaces: a "load before shard" branch keyed on "is the model on meta?" whose
else-branch assumed the weights had come with the build, so models built on a real device under
DDP and Megatron-FSDP trained from random weights without a word. Here no branch asks the model
anything. The plan is a function of (model source, strategy, world size, tp size, checkpoint
present) only, and it is the ordered list of steps the pipeline executes — so "the checkpoint is
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


class Step(str, Enum):
    BUILD_ON_META = "build on meta (architecture only, no weights, no init)"
    SHARD = "shard"
    MATERIALIZE = "materialize (allocate each rank's storage)"
    READ_CHECKPOINT = "read the checkpoint into place"
    INITIALIZE_REST = "initialize what was not read"
    AUDIT = "audit every parameter's provenance"


_SHARDS_ON_META = {"ddp": False, "fsdp2": True, "megatron_fsdp": False}


@dataclass(frozen=True)
class LoadPlan:
    """What will happen, in order, and why. Pure data: printable without a process group."""

    model_class: str
    is_custom: bool
    source_reason: str
    strategy: str | None  # None: one process, no sharding
    world_size: int
    tp_size: int
    has_checkpoint: bool
    steps: tuple[Step, ...]
    read_scope: str
    initialize_scope: str
    shard_reason: str

    @property
    def weights_arrive_with_build(self) -> bool:
        """Never: the build is on meta. Stated so that no code can assume otherwise."""
        return False

    @property
    def init_device(self) -> str:
        return "meta"

    @property
    def checkpoint_reads(self) -> int:
        return self.steps.count(Step.READ_CHECKPOINT)

    def __str__(self) -> str:
        where = "one process" if self.strategy is None else f"{self.strategy} on {self.world_size} rank(s), tp={self.tp_size}"
        lines = [
            f"load plan: {self.model_class} ({'custom' if self.is_custom else 'transformers'}: {self.source_reason}), {where}",
            "  weights arrive with the build: no (built on meta)",
        ]
        lines += [f"  {number}. {step.value}" for number, step in enumerate(self.steps, 1)]
        lines.append(f"  checkpoint: {self.read_scope}")
        lines.append(f"  initialize: {self.initialize_scope}")
        if self.strategy is not None:
            lines.append(f"  sharding: {self.shard_reason}")
        return "\n".join(lines)


def make_load_plan(
    model_class: str,
    is_custom: bool,
    source_reason: str,
    strategy: str | None,
    world_size: int,
    tp_size: int,
    has_checkpoint: bool,
) -> LoadPlan:
    """The one place loading is decided. Pure: no I/O, no torch, no process group."""
    if strategy is None:
        shard_first, shard_reason = False, "none"
        middle = [Step.MATERIALIZE]
        after: list[Step] = []
    elif _SHARDS_ON_META[strategy]:
        shard_first = True
        shard_reason = f"{strategy} shards the meta model first, so each rank allocates only its own shards"
        middle = [Step.SHARD, Step.MATERIALIZE]
        after = []
    else:
        shard_first = False
        shard_reason = f"{strategy} needs real full weights: shard after they are in place"
        middle = [Step.MATERIALIZE]
        after = [Step.SHARD]
    steps = [Step.BUILD_ON_META, *middle]
    if has_checkpoint:
        steps.append(Step.READ_CHECKPOINT)
        read_scope = (
            "read once, each rank reading only the slices of its own shards"
            if shard_first
            else "read once, every rank reading the full tensors (they are replicated)"
        )
        initialize_scope = "only parameters the checkpoint lacks that are tied or explicitly allowed (strict=False)"
    else:
        read_scope = "none given: nothing is read"
        initialize_scope = "every parameter and buffer (seeded, identical under any sharding)"
    steps.append(Step.INITIALIZE_REST)
    steps += after
    steps.append(Step.AUDIT)
    return LoadPlan(
        model_class=model_class,
        is_custom=is_custom,
        source_reason=source_reason,
        strategy=strategy,
        world_size=world_size,
        tp_size=tp_size,
        has_checkpoint=has_checkpoint,
        steps=tuple(steps),
        read_scope=read_scope,
        initialize_scope=initialize_scope,
        shard_reason=shard_reason,
    )
