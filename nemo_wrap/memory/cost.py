"""The cost model ``--auto`` ranks layouts by: the seconds a step spends beyond its share of the
model's arithmetic, that is communication and recomputation.

Every layout of a job does the same arithmetic (6 FLOPs per parameter per token, split evenly over
the ranks), so what tells them apart is what each parallelism sends per step and whether a forward
is run twice. Per rank and step, with ``f(n) = (n - 1) / n``, P the parameters' bytes and G the
trainable ones', ``k`` micro-batches of ``m`` rows of ``s`` tokens and ``L`` decoder layers:

- DDP over D ranks: one all-reduce of the gradients, ``2 f(D) G``.
- FSDP over S ranks (dp_shard × cp): each micro-batch gathers the weights a stage holds for the
  forward and again for the backward, ``2 k f(S) P / (tp pp)``; one reduce-scatter,
  ``f(S) G / (tp pp)``. Under expert parallel over e ranks the experts (``Pe``, ``Ge``) are whole
  per rank, ``1/e`` of them, and sharded over ``E = dp_shard tp / e``: ``f(E) (2 k Pe + Ge) / (e pp)``.
- HSDP's R replicas: an all-reduce of each shard's gradients, ``2 f(R) G / (tp S)``.
- Tensor parallel over t ranks: two all-reduces of the ``m s / cp × hidden`` activations per layer
  a stage holds in the forward and two in the backward (one more forward's two if recomputed),
  ``2 f(t)`` each.
- Context parallel over c ranks: the ring passes each rank's keys and values ``c - 1`` times per
  layer in the forward, and keys, values and their gradients in the backward.
- Expert parallel over e ranks: per MoE layer a stage holds, each of its ``m s / (cp tp)`` tokens
  goes to its top-k experts and comes back (two all-to-alls of ``f(e)`` of them) in the forward,
  the same in the backward, and again if recomputed.
- Pipeline over p stages (1F1B, k micro-batches): the bubble, ``(p - 1) / k`` of a rank's share of
  the arithmetic (6 FLOPs per parameter per token), idle; and each micro-batch's hidden states sent
  to the next stage and their gradients back.
- Recomputation: one more forward, ``2 × parameters × tokens / world`` FLOPs.

A group within one node moves at ``Machine.intra_node_bandwidth``, one that spans nodes at
``inter_node_bandwidth`` (ranks fill nodes in order, the mesh's last dimension fastest). Nothing
is assumed to overlap with compute: the cost is what the step would take if nothing hid it, an
upper bound that ranks layouts, not a step-time prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_wrap.distributed.combinations import Feature
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.memory.layouts import Layout, Machine


@dataclass(frozen=True)
class ModelSizes:
    """What the cost model and the search need of the model: sizes, not values."""

    parameters: int  # count, for the arithmetic
    parameter_bytes: int
    trainable_bytes: int
    hidden_size: int
    kv_size: int  # key/value heads × head size
    layers: int
    activation_bytes: int  # bytes per activation element
    experts: int = 0  # per MoE layer (0: dense)
    experts_per_token: int = 0
    moe_layers: int = 0
    expert_bytes: int = 0  # the experts' parameter bytes, in every MoE layer
    expert_trainable_bytes: int = 0
    sequence_parallel: bool = False  # whether its architecture has a sequence-parallel plan


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
    parts = _data_parallel_parts(layout, setup, sizes, machine)
    tokens = layout.micro_batch * seq_len // layout.cp  # per rank per micro-batch
    forwards = 2 if layout.activation_checkpointing else 1
    exchanges = layout.accumulation * (2 * forwards + 2)  # per layer: forward(s) and backward, two each
    if layout.tp > 1:
        activations = tokens * sizes.hidden_size * sizes.activation_bytes
        volume = exchanges * sizes.layers / layout.pp * 2 * _f(layout.tp) * activations
        parts.append(("tp all-reduce", _seconds(volume, layout.tp > per_node, machine)))
    if layout.cp > 1:
        keys_values = 2 * tokens * sizes.kv_size * sizes.activation_bytes
        volume = layout.accumulation * sizes.layers / layout.pp * (forwards + 2) * (layout.cp - 1) * keys_values
        parts.append(("cp ring", _seconds(volume, layout.cp * layout.tp > per_node, machine)))
    if layout.ep > 1:
        routed = tokens // layout.tp * sizes.experts_per_token * sizes.hidden_size * sizes.activation_bytes
        volume = exchanges * sizes.moe_layers / layout.pp * _f(layout.ep) * routed
        parts.append(("ep all-to-all", _seconds(volume, layout.ep * layout.tp > per_node, machine)))
    step_tokens = layout.micro_batch * layout.accumulation * seq_len * setup.dp_size
    arithmetic = 6 * sizes.parameters * step_tokens / world / machine.flops
    if layout.pp > 1:
        parts.append(("pp bubble", (layout.pp - 1) / layout.accumulation * arithmetic))
        volume = 2 * layout.accumulation * tokens * sizes.hidden_size * sizes.activation_bytes / layout.tp
        parts.append(("pp send/recv", _seconds(volume, world // layout.pp >= per_node and machine.nnodes > 1, machine)))
    if layout.activation_checkpointing:
        parts.append(("recompute", arithmetic / 3))
    return StepCost(tuple(parts))


def _data_parallel_parts(
    layout: Layout, setup: DistributedSetup, sizes: ModelSizes, machine: Machine
) -> list[tuple[str, float]]:
    """DDP's all-reduce, or FSDP's gathers and reduce-scatter (the experts' over their own ranks
    under expert parallel) and HSDP's all-reduce."""
    world, per_node, held = machine.world_size, machine.nproc_per_node, layout.tp * layout.pp
    if Feature.REPLICATED in setup.entry.traits:  # DDP
        return [("ddp all-reduce", _seconds(2 * _f(world) * sizes.trainable_bytes, world > per_node, machine))]
    dp_shard = setup.degrees.dp_shard
    shards = dp_shard * layout.cp  # what FSDP shards over
    expert, expert_trainable = (sizes.expert_bytes, sizes.expert_trainable_bytes) if layout.ep > 1 else (0, 0)
    dense = 2 * layout.accumulation * (sizes.parameter_bytes - expert) + sizes.trainable_bytes - expert_trainable
    parts = []
    if shards > 1:
        volume = _f(shards) * dense / held
        parts.append(("fsdp gather/scatter", _seconds(volume, shards * layout.tp > per_node, machine)))
    expert_shards = dp_shard * layout.tp // layout.ep
    if expert and expert_shards > 1:
        volume = _f(expert_shards) * (2 * layout.accumulation * expert + expert_trainable) / (layout.ep * layout.pp)
        parts.append(("expert fsdp gather/scatter", _seconds(volume, dp_shard * layout.tp > per_node, machine)))
    if layout.dp_replicate > 1:
        volume = 2 * _f(layout.dp_replicate) * sizes.trainable_bytes / (held * shards)
        parts.append(("hsdp all-reduce", _seconds(volume, world > per_node, machine)))
    return parts


def _f(ranks: int) -> float:
    """The share of a buffer each rank sends in a ring collective over ``ranks``."""
    return (ranks - 1) / ranks


def _seconds(volume: float, spans_nodes: bool, machine: Machine) -> float:
    return volume / (machine.inter_node_bandwidth if spans_nodes else machine.intra_node_bandwidth)
