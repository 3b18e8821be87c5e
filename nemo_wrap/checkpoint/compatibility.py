"""Whether a resumable checkpoint fits the model and optimizer it is loaded into, asked before loading.

Left to itself, DCP's load refuses a key the checkpoint lacks with a bare ``RuntimeError`` from the
first rank that plans a read of it, and silently skips what the checkpoint holds beyond the model:
a LoRA run's checkpoint loaded into a model built without adapters leaves the adapters behind
without a word. A resume that is wrong that way trains on from a state nobody saved. So the
checkpoint's index (:func:`nemo_wrap.checkpoint.manifest.checkpoint_layout`) is compared with the
keys and global shapes DCP would load — the state dict flattened exactly as DCP flattens it — and a
difference is refused on every rank with one :class:`CheckpointMismatchError` naming the directory,
what differs and how many, and what a LoRA-versus-full difference means.

Shapes are global (a DTensor's ``size()``), so the comparison holds on any topology: DCP reshards
a checkpoint written on one mesh onto another. A pipeline stage holds only its own layers, so a
checkpoint key counts as unexpected only when no rank expects it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # the rule DCP's load planner applies
from torch.distributed.checkpoint.stateful import Stateful

from nemo_wrap.checkpoint.manifest import Layout
from nemo_wrap.distributed.collectives import RankGroup, collective_device
from nemo_wrap.errors import CheckpointMismatchError, summarize
from nemo_wrap.models.lora import is_lora_parameter

_COMPARED = ("model", "optimizer")  # what the checkpoint must not hold more of; data and step may be left unread
_SHOWN = 5


def expected_layout(state: Mapping[str, Any]) -> Layout:
    """The flattened keys DCP would load ``state`` through, with each tensor's global shape (``None``
    for a value DCP stores as bytes)."""
    plain = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state.items()}
    flat, _ = flatten_state_dict(plain)
    return {key: tuple(value.size()) if isinstance(value, torch.Tensor) else None for key, value in flat.items()}


def require_fit(directory: Path, saved: Layout, state: Mapping[str, Any], group: RankGroup) -> None:
    """Raise :class:`CheckpointMismatchError` on every rank of ``group`` unless every rank's
    ``state`` finds each of its keys in ``saved`` with the same shape, and every model and optimizer
    key of ``saved`` is wanted by some rank. Collective in a collective group."""
    expected = expected_layout(state)
    unexpected = _unwanted_anywhere(saved, expected, group)
    problem = _describe(directory, saved, expected, unexpected)
    problems: list[str | None] = [problem]
    if group.collective:
        problems = [None] * group.size
        dist.all_gather_object(problems, problem, group=group.process_group)
    found = [text for text in problems if text is not None]
    if found:
        raise CheckpointMismatchError(found[0])


def _unwanted_anywhere(saved: Layout, expected: Layout, group: RankGroup) -> list[str]:
    """The model and optimizer keys of ``saved`` that no rank's state has (one small all-reduce)."""
    names = sorted(key for key in saved if key.partition(".")[0] in _COMPARED)
    wanted = torch.tensor([name in expected for name in names], dtype=torch.int32, device=collective_device())
    if group.collective and names:
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX, group=group.process_group)
    return [name for name, flag in zip(names, wanted.tolist(), strict=True) if not flag]


def _describe(directory: Path, saved: Layout, expected: Layout, unexpected: list[str]) -> str | None:
    """What keeps ``saved`` from loading into ``expected`` (``None``: nothing)."""
    missing = sorted(set(expected) - set(saved))
    reshaped = sorted(key for key in set(expected) & set(saved) if expected[key] != saved[key])
    if not (missing or unexpected or reshaped):
        return None
    parts = [f"{directory}: the checkpoint does not fit this model and optimizer; nothing was loaded"]
    lora = _lora_difference(saved, expected)
    if lora is not None:
        parts.append(lora)
    if missing:
        parts.append(
            f"{len(missing)} key(s) {_by_section(missing)} missing from the checkpoint: {summarize(missing, _SHOWN)}"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} key(s) {_by_section(unexpected)} in the checkpoint that this model and optimizer "
            f"do not have: {summarize(unexpected, _SHOWN)}"
        )
    if reshaped:
        shown = ", ".join(
            f"{key!r} {_shape(saved[key])} saved, {_shape(expected[key])} here" for key in reshaped[:_SHOWN]
        )
        more = f" and {len(reshaped) - _SHOWN} more" if len(reshaped) > _SHOWN else ""
        parts.append(f"{len(reshaped)} key(s) {_by_section(reshaped)} with another shape: {shown}{more}")
    return "; ".join(parts)


def _lora_difference(saved: Layout, expected: Layout) -> str | None:
    """The likely cause when LoRA adapters are on one side only."""
    saved_adapters = sum(1 for key in saved if key.startswith("model.") and is_lora_parameter(key))
    own_adapters = sum(1 for key in expected if key.startswith("model.") and is_lora_parameter(key))
    if saved_adapters and not own_adapters:
        return (
            f"it is a LoRA checkpoint ({saved_adapters} adapter tensors) and this model has no LoRA adapters: "
            "build the model with the peft_config the run was trained with"
        )
    if own_adapters and not saved_adapters:
        return (
            f"it is a checkpoint of a model without LoRA adapters and this model has {own_adapters} adapter "
            "tensors: build the model without peft_config, or resume from a checkpoint of the LoRA run"
        )
    return None


def _by_section(keys: list[str]) -> str:
    """``(model: 2, optimizer: 6)``: how many of ``keys`` fall in each part of the state."""
    counts: dict[str, int] = {}
    for key in keys:
        section = key.partition(".")[0]
        counts[section] = counts.get(section, 0) + 1
    return "(" + ", ".join(f"{section}: {count}" for section, count in counts.items()) + ")"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "a non-tensor value" if shape is None else str(list(shape))
