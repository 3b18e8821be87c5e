"""Config sanity, checked before a model is built on meta.

transformers validates some config fields, but a config it accepts can still ask for zero attention
heads (a ``ZeroDivisionError`` mid-build), negative sizes (a torch ``RuntimeError``), 10**12
vocabulary rows (an attempt to allocate 256 TB) or a million layers (minutes of building modules on
meta before any check of the checkpoint runs). Each is refused here, naming the field, while it is
still cheap to refuse.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Iterable

import torch
from transformers import PretrainedConfig, PreTrainedModel

from nemo_wrap.errors import ShapeMismatchError, UnsupportedModelError

# Sizes every decoder must have positive, by the names transformers' configs answer to (``n_embd``
# and the like map onto them through each config's ``attribute_map``).
_POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
)
# Sizes that may be zero (a dense model has no experts) but never negative.
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")
_NON_NEGATIVE_SIZES = (*_EXPERT_COUNTS, "moe_intermediate_size")
# Checkpoint keys of decoder layers: ``model.layers.3.``, GPT-2's ``transformer.h.3.``, ``blocks.3.``.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def describe_config(config: PretrainedConfig) -> str:
    """How errors name a config: its file when it was read from one, and its class."""
    origin = getattr(config, "name_or_path", "")
    return f"{origin}/config.json ({type(config).__name__})" if origin else type(config).__name__


def check_config_sizes(config: PretrainedConfig) -> None:
    """Sizes that are integers of the right sign, and head counts that divide what they split."""
    name = describe_config(config)
    for field in (*_POSITIVE_SIZES, *_NON_NEGATIVE_SIZES):
        value = getattr(config, field, None)
        if value is None:
            continue
        lowest = 1 if field in _POSITIVE_SIZES else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise UnsupportedModelError(f"{name}: {field} = {value!r} must be an integer >= {lowest}")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        raise UnsupportedModelError(
            f"{name}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}"
        )
    vocab, pad = getattr(config, "vocab_size", None), getattr(config, "pad_token_id", None)
    if vocab and isinstance(pad, int) and not -vocab <= pad < vocab:  # nn.Embedding's own rule
        raise UnsupportedModelError(f"{name}: pad_token_id = {pad} is outside the vocabulary of {vocab}")
    hidden = getattr(config, "hidden_size", None)
    if heads and hidden and getattr(config, "head_dim", None) is None and hidden % heads:
        raise UnsupportedModelError(
            f"{name}: hidden_size = {hidden} is not a multiple of num_attention_heads = {heads} (and no head_dim)"
        )


def check_layer_count(
    config: PretrainedConfig, model_class: type[PreTrainedModel], checkpoint_keys: Collection[str]
) -> None:
    """A config that asks for more decoder layers than the checkpoint holds is the wrong config.

    Checked only where ``num_hidden_layers`` is what numbers the ``layers.N`` modules of
    ``model_class`` (some families count their layers otherwise), and only when the counts
    disagree, so a normal load pays nothing. (Fewer layers than the checkpoint is left to the key
    checks: a checkpoint may carry extra layers, such as multi-token prediction heads.)
    """
    layers = getattr(config, "num_hidden_layers", None)
    held = _layer_indices(checkpoint_keys)
    if not isinstance(layers, int) or not held or layers <= max(held) + 1:
        return
    if _numbers_its_layers(config, model_class):
        raise ShapeMismatchError(
            f"{describe_config(config)}: num_hidden_layers = {layers}, but the checkpoint holds layers "
            f"0..{max(held)} only: the config does not belong to these weights"
        )


def _layer_indices(names: Iterable[str]) -> set[int]:
    return {int(match.group(1)) for name in names if (match := _LAYER_INDEX.search(name))}


def _numbers_its_layers(config: PretrainedConfig, model_class: type[PreTrainedModel]) -> bool:
    """Whether ``model_class`` built on meta with 1 and then 2 layers has layers {0}, then {0, 1}."""
    seen = []
    for depth in (1, 2):
        probe = copy.deepcopy(config)
        probe.num_hidden_layers = depth
        try:
            with torch.device("meta"):
                seen.append(_layer_indices(name for name, _ in model_class(probe).named_parameters()))
        except Exception:  # a family whose other fields must agree with the depth: no verdict
            return False
    return seen == [{0}, {0, 1}]


def minimum_parameter_count(config: PretrainedConfig) -> int:
    """A lower bound on the parameters ``config`` describes: embeddings plus, per layer, the
    attention's query and output projections and two MLP matrices (per expert for MoE).

    A lower bound, so that refusing a model for its size never refuses one that would fit.
    """
    hidden = getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    experts = max([1, *(getattr(config, f, 0) or 0 for f in _EXPERT_COUNTS)])
    ffn = (getattr(config, "moe_intermediate_size", None) if experts > 1 else None) or getattr(
        config, "intermediate_size", 0
    )
    per_layer = 2 * heads * head_dim * hidden + 2 * hidden * (ffn or 0) * experts
    return (getattr(config, "vocab_size", 0) or 0) * hidden + (getattr(config, "num_hidden_layers", 0) or 0) * per_layer


def check_size_budget(config: PretrainedConfig, element_size: float, parameter_shards: int, memory_bytes: int) -> None:
    """Refuse a model whose share per rank cannot fit in this device's memory, before building it;
    ``element_size`` is bytes per parameter (0.5 for 4-bit weights)."""
    per_rank = int(minimum_parameter_count(config) * element_size) // parameter_shards
    if per_rank > memory_bytes:
        sizes = {f: getattr(config, f, None) for f in ("vocab_size", "hidden_size", "num_hidden_layers")}
        raise UnsupportedModelError(
            f"{describe_config(config)}: {', '.join(f'{k}={v}' for k, v in sizes.items())} needs at least "
            f"{per_rank / 2**30:.1f} GiB of parameters per rank, more than this device's {memory_bytes / 2**30:.1f} GiB"
        )
