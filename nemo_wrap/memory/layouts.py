"""The layouts ``--auto`` chooses among: the ways to run one job on one machine that the dry run
can predict.

A layout is the setup's degrees (strategy, tensor-parallel, context-parallel, HSDP replicas,
pipeline stages, expert-parallel), whether each decoder layer recomputes its activations in the
backward, and the micro-batch. Tensor parallel cuts its stream along the sequence wherever the
architecture has the plan for it and no pipeline runs beside it: the same bytes exchanged as
without, fewer activations kept, so there is nothing to choose. The job stays the one the user
asked for: every layout takes the same rows per optimizer step over all data-parallel ranks (the
global batch) of the same tokens, so they train the same steps and differ only in memory and
cost. A pipeline runs 1F1B over a step's micro-batches, so it takes at least one micro-batch per
stage. Not enumerated: tensor parallel across nodes (its per-layer exchanges would run at the
inter-node speed), Megatron-FSDP (the dry run cannot trace it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.memory.prediction import TrainingShape

# (strategy, tp, cp, HSDP replicas, pp, ep): what a layout shards by
Degrees = tuple[str, int, int, int, int, int]


@dataclass(frozen=True)
class Machine:
    """What the job runs on, and the speeds the cost model charges (:mod:`.cost`). The defaults
    are a node of 80 GB H100s: an NVLink collective sustains about 150 GB/s per GPU, a 400 Gb/s
    InfiniBand link per GPU about 40 GB/s, and a training step about 400 TFLOP/s per GPU in bf16
    (40% of the dense peak). Only the ranking uses them: the memory prediction does not."""

    nproc_per_node: int
    device_memory: int  # bytes per device
    nnodes: int = 1
    intra_node_bandwidth: float = 150e9  # bytes/s per rank in a collective within a node
    inter_node_bandwidth: float = 40e9  # bytes/s per rank in a collective across nodes
    flops: float = 400e12  # sustained FLOP/s per device in a training step

    def __post_init__(self) -> None:
        for name in ("nproc_per_node", "device_memory", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidSetupError(f"Machine: {name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the degrees, the micro-batch (rows per rank) and micro-batches per
    step, and whether activations are recomputed."""

    strategy: str  # "ddp" | "fsdp2": the registry's names
    micro_batch: int
    accumulation: int
    activation_checkpointing: bool = False
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    dp_replicate: int = 1
    pp: int = 1
    ep: int = 1

    def setup(self, world_size: int) -> DistributedSetup:
        return DistributedSetup.build(
            self.strategy,
            world_size,
            tp_size=self.tp,
            cp_size=self.cp,
            dp_replicate_size=self.dp_replicate,
            pp_size=self.pp,
            ep_size=self.ep,
            sequence_parallel=self.sequence_parallel,
        )

    def shape(self, seq_len: int) -> TrainingShape:
        return TrainingShape(self.micro_batch, seq_len, self.accumulation, self.activation_checkpointing)

    @property
    def degrees(self) -> Degrees:
        """What the layout shards by: variants of the same degrees differ in batch and recompute only."""
        return (self.strategy, self.tp, self.cp, self.dp_replicate, self.pp, self.ep)

    def describe(self) -> str:
        named = (("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("ep", self.ep))
        degrees = [f"{name} {size}" for name, size in named if size > 1]
        if self.sequence_parallel:
            degrees.append("sequence parallel")
        if self.dp_replicate > 1:
            degrees.append(f"{self.dp_replicate} replicas")
        recomputed = ", recomputed" if self.activation_checkpointing else ""
        batches = f"{self.micro_batch} row(s) × {self.accumulation} micro-batch(es)"
        return f"{' '.join([self.strategy, *degrees])}, {batches}{recomputed}"

    def recipe(self, machine: Machine) -> dict[str, dict[str, Any]]:
        """The recipe keys that run this layout with ``nemo-wrap finetune`` (``nproc`` on one node;
        on several, torchrun's own flags say how many ranks)."""
        distributed: dict[str, Any] = {"strategy": self.strategy}
        if machine.nnodes == 1:
            distributed["nproc"] = machine.nproc_per_node
        distributed.update(tp_size=self.tp, cp_size=self.cp, dp_replicate_size=self.dp_replicate)
        if self.sequence_parallel:
            distributed["sequence_parallel"] = True
        if self.pp > 1:
            distributed.update(pp_size=self.pp, pp_schedule="1f1b")
        if self.ep > 1:
            distributed["ep_size"] = self.ep
        training = {
            "batch_size": self.micro_batch,
            "accumulation": self.accumulation,
            "activation_checkpointing": self.activation_checkpointing,
        }
        return {"distributed": distributed, "training": training}


def candidate_layouts(
    machine: Machine, global_batch: int, layers: int, experts: int, sequence_parallel: bool = False
) -> tuple[Layout, ...]:
    """Every layout of ``machine`` that takes ``global_batch`` rows a step, for a model of ``layers``
    decoder layers and ``experts`` experts a MoE layer (0: dense): each degree combination whose
    data-parallel ranks share the rows evenly, with every micro-batch that divides a rank's rows
    (a pipeline's micro-batches at least its stages), with and without recomputing activations;
    with tensor parallel cut along the sequence if the architecture has the plan
    (``sequence_parallel``) and no pipeline runs."""
    layouts = []
    for strategy, tp, cp, replicas, pp, ep in _degree_combinations(machine, layers, experts):
        cut = sequence_parallel and tp > 1 and pp == 1
        data_parallel = machine.world_size // (tp * cp * pp)
        if global_batch % data_parallel:
            continue
        rows = global_batch // data_parallel
        for micro_batch in (size for size in range(rows, 0, -1) if rows % size == 0 and rows // size >= pp):
            for recompute in (False, True):
                batches = rows // micro_batch
                layouts.append(Layout(strategy, micro_batch, batches, recompute, tp, cut, cp, replicas, pp, ep))
    return tuple(layouts)


def _degree_combinations(machine: Machine, layers: int, experts: int) -> list[Degrees]:
    """(strategy, tp, cp, replicas, pp, ep): DDP; fsdp2 with tp within a node, pipeline stages (up
    to one a layer) and cp over what is left; on several nodes also HSDP with one replica per node
    (shards within the node); for a MoE model, each of those with every expert-parallel degree that
    divides the experts and the ranks of a stage that share a batch's data (``dp_shard × tp``).
    One rank runs what ``nemo-wrap finetune`` runs there: fsdp2 on a world of one."""
    world = machine.world_size
    combinations = [("ddp", 1, 1, 1, 1, 1)] if world > 1 else []
    for tp in _divisors(world):
        if tp > machine.nproc_per_node:
            continue
        for pp in (size for size in _divisors(world // tp) if size <= layers):
            for cp in _divisors(world // (tp * pp)):
                data_parallel = world // (tp * cp * pp)
                replicas = [1]
                if machine.nnodes > 1 and data_parallel % machine.nnodes == 0 and data_parallel > machine.nnodes:
                    replicas.append(machine.nnodes)
                for replica in replicas:
                    shards = data_parallel // replica
                    for ep in _expert_degrees(experts, shards * tp):
                        combinations.append(("fsdp2", tp, cp, replica, pp, ep))
    return combinations


def _expert_degrees(experts: int, ranks: int) -> list[int]:
    """1, and for a MoE model every degree that divides both its experts and ``ranks``."""
    return [1] + [size for size in _divisors(ranks) if size > 1 and experts and experts % size == 0]


def _divisors(number: int) -> list[int]:
    return [size for size in range(1, number + 1) if number % size == 0]
