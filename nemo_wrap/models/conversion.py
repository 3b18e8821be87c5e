"""transformers' own checkpoint conversion, honoured as data: renamed keys and merged MoE experts.

transformers 5 keeps some families' checkpoints in their original layout and converts on load
(``transformers.conversion_mapping``): GPT-NeoX's ``embed_out`` is the model's ``lm_head``;
Mixtral, Qwen-MoE, DeepSeek, OLMoE store one tensor per expert while the model holds 3-D
``experts.gate_up_proj`` / ``experts.down_proj`` stacked over experts (``MergeModulelist``) and
concatenated (``Concatenate``). Rather than running those operations on whole tensors, each model
tensor is described as windows of checkpoint tensors (:class:`SourceBlock`), so every rank reads only
the experts and rows of its own shard. Saving reverses the mapping with transformers' own
``revert_weight_conversion``, so what is written is what transformers writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)

from nemo_wrap.errors import MissingWeightsError, UnsupportedModelError, summarize
from nemo_wrap.state_dict import SourceBlock, whole

Shapes = Mapping[str, tuple[int, ...]]


def conversion_transforms(architecture: str, model_type: str) -> list[WeightTransform]:
    """transformers' transforms for a causal LM's checkpoints (class-specific first, as transformers
    looks them up), without the legacy renamings; empty when its checkpoints need none."""
    return get_checkpoint_conversion_mapping(architecture) or get_checkpoint_conversion_mapping(model_type) or []


@dataclass
class _Group:
    """The checkpoint keys that make one model tensor, and the converter that joins them (if any)."""

    converter: WeightConverter | None
    keys_by_pattern: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class _ConvertedModel:
    """What ``revert_weight_conversion`` reads of a model: its transforms and its config."""

    _weight_conversions: list[WeightTransform]
    config: PretrainedConfig


class TransformersConversion:
    """A :class:`StateDictAdapter` that applies transformers' conversion mapping of one model.

    ``checkpoint_shapes`` (key → shape) is the checkpoint being read; it may be empty when the
    adapter only saves. Raises :class:`UnsupportedModelError` naming a converter whose operations
    have no window form (anything beyond merging experts and concatenating).
    """

    def __init__(
        self,
        transforms: list[WeightTransform],
        config: PretrainedConfig,
        parameter_names: list[str],
        base_model_prefix: str,
        checkpoint_shapes: Shapes,
    ) -> None:
        self._transforms = transforms
        self._config = config
        self._shapes = checkpoint_shapes
        for converter in self._converters():
            _check_supported(converter)
        self._groups = self._group(parameter_names, base_model_prefix)

    def _converters(self) -> list[WeightConverter]:
        return [t for t in self._transforms if isinstance(t, WeightConverter)]

    def _group(self, parameter_names: list[str], base_model_prefix: str) -> dict[str, _Group]:
        """Model tensor → the checkpoint keys that fill it, found by transformers' own renaming."""
        renamings = [t for t in self._transforms if isinstance(t, WeightRenaming)]
        converters = self._converters()
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        known = dict.fromkeys(parameter_names, True)
        groups: dict[str, _Group] = {}
        for key in sorted(self._shapes, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, base_model_prefix, known)
            converter = by_pattern.get(pattern) if pattern is not None else None
            group = groups.setdefault(target, _Group(converter))
            group.keys_by_pattern.setdefault(pattern or key, []).append(key)
        return groups

    def blocks(self, key: str, shape: tuple[int, ...]) -> list[SourceBlock]:
        group = self._groups.get(key)
        if group is None:
            return []
        missing = _missing_experts(group, shape)
        if missing:
            raise MissingWeightsError(
                f"{key}: the checkpoint holds some of its {shape[0]} experts but lacks {summarize(missing)}; "
                "merged by position, the next experts would shift into the missing ones' places"
            )
        if group.converter is None:
            source = next(iter(group.keys_by_pattern.values()))[0]  # others renamed alike stay unused
            return [SourceBlock(source, whole(shape), whole(self._shapes[source]))]
        return _converted_blocks(group, self._shapes)

    def expected_keys(self, key: str) -> tuple[str, ...]:
        group = self._groups.get(key)
        if group is None:
            return (key,)
        return tuple(k for keys in group.keys_by_pattern.values() for k in keys)

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converted: Any = _ConvertedModel(self._transforms, self._config)
        return revert_weight_conversion(converted, dict(state_dict))


def _is_supported(converter: WeightConverter) -> bool:
    operations = [type(op) for op in converter.operations]
    merges = [op for op in converter.operations if isinstance(op, MergeModulelist)]
    return operations in _SUPPORTED_CHAINS and all(op.dim == 0 for op in merges)


_SUPPORTED_CHAINS = ([MergeModulelist], [MergeModulelist, Concatenate], [Concatenate])


def _check_supported(converter: WeightConverter) -> None:
    if not _is_supported(converter):
        raise UnsupportedModelError(
            f"transformers converts checkpoint keys {converter.source_patterns} to {converter.target_patterns} "
            f"with {converter.operations}, which nemo_wrap cannot read shard by shard (supported: merging "
            "experts along dim 0, then concatenating)"
        )


def require_supported(transforms: list[WeightTransform]) -> None:
    """Raise :class:`UnsupportedModelError` naming the first converter nemo_wrap cannot read."""
    for transform in transforms:
        if isinstance(transform, WeightConverter):
            _check_supported(transform)


def describe_conversion(transforms: list[WeightTransform]) -> str:
    """One line for the load plan: what transformers' mapping does to this family's keys."""
    if not transforms:
        return "transformers' keys as they are"
    renamings = sum(isinstance(t, WeightRenaming) for t in transforms)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    chains = sorted({"+".join(type(op).__name__ for op in c.operations) for c in converters})
    return f"transformers' conversion mapping ({renamings} renaming(s); converters: {', '.join(chains) or 'none'})"


def _expert_index(pattern: str, key: str) -> re.Match[str] | None:
    """Where ``key`` holds its expert index in a merged pattern (the last ``*``: ``experts.*.w1.weight``)."""
    return re.search(re.escape(pattern).replace(r"\*", r"(\d+)") + "$", key)


def _missing_experts(group: _Group, shape: tuple[int, ...]) -> list[str]:
    """The per-expert keys a merged tensor of ``shape`` (experts on dim 0) needs and the checkpoint
    lacks: merging by position would shift the next experts into a missing one's place."""
    if group.converter is None or not isinstance(group.converter.operations[0], MergeModulelist) or not shape:
        return []
    missing = []
    for pattern in group.converter.source_patterns:
        matches = [m for m in (_expert_index(pattern, k) for k in group.keys_by_pattern.get(pattern, [])) if m]
        present = {int(m.group(m.lastindex or 0)) for m in matches}
        if matches and present != set(range(shape[0])):
            example = matches[0]
            start, end = example.span(example.lastindex or 0)
            missing += [
                f"{example.string[:start]}{e}{example.string[end:]}" for e in range(shape[0]) if e not in present
            ]
    return missing


def _converted_blocks(group: _Group, shapes: Shapes) -> list[SourceBlock]:
    """Windows for ``[MergeModulelist(0)]``, ``[MergeModulelist(0), Concatenate(d)]``, ``[Concatenate(d)]``.

    Merged: checkpoint key ``e`` of each pattern is index ``e`` of the model tensor's dim 0.
    Concatenated: pattern ``p`` occupies the next ``size_p`` indices of the concatenation dim, in
    the converter's pattern order.
    """
    assert group.converter is not None
    operations = group.converter.operations
    merged = isinstance(operations[0], MergeModulelist)
    concat_dim = next((op.dim for op in operations if isinstance(op, Concatenate)), None)
    # the concatenation dim counted in the checkpoint tensor, which lacks the stacked expert dim
    position = None if concat_dim is None else concat_dim - 1 if merged else concat_dim
    blocks = []
    offset = 0
    for pattern in group.converter.source_patterns:
        keys = group.keys_by_pattern.get(pattern, [])
        for index, key in enumerate(keys):
            source = whole(shapes[key])
            target = list(source)
            if position is not None:
                target[position] = slice(offset, offset + shapes[key][position])
            if merged:
                target = [slice(index, index + 1), *target]
            blocks.append(SourceBlock(key, tuple(target), source))
        if position is not None and keys:
            offset += shapes[keys[0]][position]
    return blocks
