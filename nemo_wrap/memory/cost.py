"""The cost model ``--auto`` ranks layouts by: the seconds a step spends beyond its share of the
model's arithmetic, that is communication and recomputation.

Every layout of a job does the same arithmetic (6 FLOPs per parameter per token, split evenly over
the ranks), so what tells them apart is what each parallelism sends per step and whether a forward
is run twice. Per rank and step, with ``f(n) = (n - 1) / n``, P the parameters' bytes and G the
trainable ones', ``k`` micro-batches of ``m`` rows of ``s`` tokens and ``L`` decoder layers:

- DDP over D ranks: one all-reduce of the gradients, ``2 f(D) G``.
- FSDP over S ranks (dp_shard × cp): each micro-batch gathers the weights for the forward and
  again for the backward, ``2 k f(S) P / tp``; one reduce-scatter, ``f(S) G / tp``.
- HSDP's R replicas: an all-reduce of each shard's gradients, ``2 f(R) G / (tp S)``.
- Tensor parallel over t ranks: two all-reduces of the ``m s / cp × hidden`` activations per layer
  in the forward and two in the backward (one more forward's two if recomputed), ``2 f(t)`` each.
- Context parallel over c ranks: the ring passes each rank's keys and values ``c - 1`` times per
  layer in the forward, and keys, values and their gradients in the backward.
- Recomputation: one more forward, ``2 × parameters × tokens / world`` FLOPs.

A group within one node moves at ``Machine.intra_node_bandwidth``, one that spans nodes at
``inter_node_bandwidth`` (ranks fill nodes in order, the mesh's last dimension fastest). Nothing
is assumed to overlap with compute: the cost is what the step would take if nothing hid it, an
upper bound that ranks layouts, not a step-time prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.memory.layouts import Layout, Machine


@dataclass(frozen=True)
class ModelSizes:
    """What the cost model needs of the model: sizes, not values."""

    parameters: int  # count, for the arithmetic
    parameter_bytes: int
    trainable_bytes: int
    hidden_size: int
    kv_size: int  # key/value heads × head size
    layers: int
    activation_bytes: int  # bytes per activation element


@dataclass(frozen=True)
class StepCost:
    """Seconds per step by cause (each exchange, and recomputation), beyond the arithmetic."""

    parts: tuple[tuple[str, float], ...]

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.parts)

    def describe(self) -> str:
        shown = ", ".join(f"{name} {seconds * 1e3:,.2f}" for name, seconds in self.parts if seconds)
        return f"{self.seconds * 1e3:,.2f} ms" + (f" ({shown})" if shown else "")


def step_cost(layout: Layout, sizes: ModelSizes, machine: Machine, seq_len: int) -> StepCost:
    """The layout's cost per step on ``machine`` (see the module's docstring for each term)."""
    world, per_node = machine.world_size, machine.nproc_per_node
    setup = layout.setup(world)
    shards = setup.degrees.dp_shard * setup.degrees.cp  # what FSDP shards over
    parts = []
    if Feature.REPLICATED in setup.entry.traits:  # DDP
        volume = 2 * _f(world) * sizes.trainable_bytes
        parts.append(("ddp all-reduce", _seconds(volume, world > per_node, machine)))
    elif shards > 1:
        gathers = 2 * layout.accumulation * sizes.parameter_bytes + sizes.trainable_bytes
        volume = _f(shards) * gathers / layout.tp
        parts.append(("fsdp gather/scatter", _seconds(volume, shards * layout.tp > per_node, machine)))
    if layout.dp_replicate > 1:
        volume = 2 * _f(layout.dp_replicate) * sizes.trainable_bytes / (layout.tp * shards)
        parts.append(("hsdp all-reduce", _seconds(volume, world > per_node, machine)))
    tokens = layout.micro_batch * seq_len // layout.cp  # per rank per micro-batch
    forwards = 2 if layout.activation_checkpointing else 1
    if layout.tp > 1:
        activations = tokens * sizes.hidden_size * sizes.activation_bytes
        volume = layout.accumulation * sizes.layers * (2 * forwards + 2) * 2 * _f(layout.tp) * activations
        parts.append(("tp all-reduce", _seconds(volume, layout.tp > per_node, machine)))
    if layout.cp > 1:
        keys_values = 2 * tokens * sizes.kv_size * sizes.activation_bytes
        volume = layout.accumulation * sizes.layers * (forwards + 2) * (layout.cp - 1) * keys_values
        parts.append(("cp ring", _seconds(volume, layout.cp * layout.tp > per_node, machine)))
    if layout.activation_checkpointing:
        step_tokens = layout.micro_batch * layout.accumulation * seq_len * setup.dp_size
        parts.append(("recompute", 2 * sizes.parameters * step_tokens / world / machine.flops))
    return StepCost(tuple(parts))


def _f(ranks: int) -> float:
    """The share of a buffer each rank sends in a ring collective over ``ranks``."""
    return (ranks - 1) / ranks


def _seconds(volume: float, spans_nodes: bool, machine: Machine) -> float:
    return volume / (machine.inter_node_bandwidth if spans_nodes else machine.intra_node_bandwidth)
