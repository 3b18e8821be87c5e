"""Which linear layers get adapters, read in transformers' module names, and PEFT's key for each.

A target is chosen as PEFT chooses it on transformers' own class — same ``target_modules`` rules
(a list of name suffixes, a regex, ``"all-linear"``), same ``exclude_modules`` — but matched
against the *parts* of our layers: the fused ``qkv_proj`` answers to ``q_proj``, ``k_proj`` and
``v_proj``, each adapted on its own rows. So ``["q_proj", "v_proj"]`` adapts the same projections
on our fused Llama as on transformers' Llama, and the adapter file names them the same way.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import partial

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle
from transformers import PreTrainedModel

from nemo_wrap.distributed.tensor_parallel import ReplicateWithGradientSum
from nemo_wrap.errors import LoraTargetError, UnsupportedLoraOptionError, summarize
from nemo_wrap.models.lora.hook import add_lora_output
from nemo_wrap.models.lora.layers import LoraAdapters, Placement, adapters_name
from nemo_wrap.models.lora.peft_views import ProjectionView
from nemo_wrap.models.lora.settings import LoraSettings
from nemo_wrap.state_dict import EncodedWeight, StateDictAdapter

# Our parameter names: <parent>.lora_<layer>.pairs.<projection>.lora_A / lora_B / lora_bias / lora_magnitude
_LORA_PARAMETER = re.compile(r"(?:^|\.)lora_[^.]+\.pairs\.[^.]+\.lora_(?:A|B|bias|magnitude)$")
_PAIRS = ".pairs."
# Each of a pair's parameters, as PEFT's state dict names it below the projection.
_PEFT_SUFFIX = {
    "lora_A": "lora_A.weight",
    "lora_B": "lora_B.weight",
    "lora_bias": "lora_B.bias",
    "lora_magnitude": "lora_magnitude_vector",
}


@dataclass(frozen=True)
class LoraTarget:
    """One adapted linear layer of ours and the transformers projections (name, our rows) it adapts."""

    module: str
    in_features: int
    out_features: int
    parts: tuple[tuple[str, Placement], ...]  # (transformers' module name, where its rows sit in ours)


def find_lora_targets(
    model: PreTrainedModel, config: LoraConfig, adapter: StateDictAdapter | None
) -> tuple[LoraConfig, list[LoraTarget]]:
    """The layers ``config`` adapts on ``model``, and ``config`` with ``"all-linear"`` spelt out (as
    PEFT saves it). Raises :class:`LoraTargetError` when nothing matches."""
    linears = _linear_layers(model)
    parts = {name: _parts(name, module, adapter) for name, module in linears.items()}
    resolved = _spell_out_all_linear(_with_default_targets(config, model.config.model_type), model, parts)
    _refuse_unadaptable(model, resolved, linears)
    targets = []
    for name, module in linears.items():
        chosen = tuple((part, rows) for part, rows in parts[name] if _matches(resolved, part))
        if chosen:
            targets.append(LoraTarget(name, module.in_features, module.out_features, chosen))
    if not targets:
        names = sorted({part.rpartition(".")[2] for options in parts.values() for part, _ in options})
        raise LoraTargetError(
            f"LoraConfig target_modules={config.target_modules!r} matches no linear layer of "
            f"{type(model).__name__} (its projections: {summarize(names)})"
        )
    return resolved, targets


def add_lora(model: PreTrainedModel, targets: list[LoraTarget], settings: LoraSettings) -> None:
    """Attach adapters to every target (as its sibling ``lora_<name>``, on the model's device and
    dtype) and freeze everything else."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for target in targets:
        layer = model.get_submodule(target.module)
        shapes = {name.rpartition(".")[2]: settings.for_projection(name) for name, _ in target.parts}
        adapters = LoraAdapters(
            target.in_features,
            target.out_features,
            _short(target.parts),
            shapes,
            settings.dropout,
            settings.bias,
            settings.dora,
        )
        device, dtype = _adapter_placement(layer)
        parent_name, _, leaf = adapters_name(target.module).rpartition(".")
        model.get_submodule(parent_name).add_module(leaf, adapters.to(device=device, dtype=dtype))
        layer.register_forward_hook(partial(add_lora_output, adapters))


def adapter_parallel_entries(model: nn.Module) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan entries of the adapters attached to ``model``: each pair is kept
    whole on every tp rank, its gradients summed over them."""
    return {
        f"{name}.pairs.{pair}": ReplicateWithGradientSum()
        for name, module in model.named_modules()
        if isinstance(module, LoraAdapters)
        for pair in module.pairs
    }


def _adapter_placement(layer: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Adapters live on their layer's device, in its weight's dtype — in float32 beside a 4-bit
    layer, whose weight has no float dtype (PEFT keeps them so over bitsandbytes' layers)."""
    if isinstance(layer, EncodedWeight):
        return next(layer.parameters()).device, torch.float32
    weight = layer.get_parameter("weight")
    return weight.device, weight.dtype


def fused_parts(model: PreTrainedModel, adapter: StateDictAdapter) -> dict[str, list[tuple[str, Placement]]]:
    """Every linear layer of ``model`` that holds several transformers projections, with each
    projection's name and where its rows sit in the layer (from the state-dict adapter)."""
    parts = {name: _parts(name, module, adapter) for name, module in _linear_layers(model).items()}
    return {name: found for name, found in parts.items() if len(found) > 1}


def is_lora_parameter(name: str) -> bool:
    return _LORA_PARAMETER.search(name) is not None


def peft_key(name: str) -> str:
    """``model.layers.0.self_attn.lora_qkv_proj.pairs.q_proj.lora_A`` →
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (PEFT's file key; a
    ``lora_bias`` is PEFT's ``lora_B.bias``, a ``lora_magnitude`` its ``lora_magnitude_vector``)."""
    module, _, rest = name.partition(_PAIRS)
    parent = module.rpartition(".")[0]
    projection, _, parameter = rest.partition(".")
    return f"base_model.model.{parent + '.' if parent else ''}{projection}.{_PEFT_SUFFIX[parameter]}"


LinearLayer = nn.Linear | EncodedWeight  # a layer with a [out_features, in_features] weight


def _linear_layers(model: nn.Module) -> dict[str, LinearLayer]:
    """The model's own linear layers, 4-bit ones included (not the parameterless views PEFT's
    wrapping uses)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, EncodedWeight)) and not isinstance(module, ProjectionView)
    }


def _parts(name: str, module: LinearLayer, adapter: StateDictAdapter | None) -> list[tuple[str, Placement]]:
    """The transformers projections in ``module``'s rows — several for a fused layer, else itself —
    each with where its rows sit in ours (from the state-dict adapter's blocks)."""
    shape = (module.out_features, module.in_features)
    blocks = adapter.blocks(f"{name}.weight", shape) if adapter is not None else []
    if len(blocks) <= 1:
        rows = slice(0, module.out_features)
        return [(name, ((rows, rows),))]
    placements: dict[str, list[tuple[slice, slice]]] = {}
    for block in blocks:
        placements.setdefault(block.hf_key.removesuffix(".weight"), []).append((block.source[0], block.target[0]))
    parent = name.rpartition(".")[0]
    if any(part.rpartition(".")[0] != parent for part in placements):
        raise UnsupportedLoraOptionError(f"{name}: its parts {sorted(placements)} are not its siblings")
    return [(part, tuple(rows)) for part, rows in placements.items()]


def _short(parts: tuple[tuple[str, Placement], ...]) -> list[tuple[str, Placement]]:
    return [(name.rpartition(".")[2], rows) for name, rows in parts]


def _spell_out_all_linear(
    config: LoraConfig, model: PreTrainedModel, parts: dict[str, list[tuple[str, Placement]]]
) -> LoraConfig:
    """PEFT turns ``"all-linear"`` into the names of every linear projection but the output layer."""
    if not (isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear"):
        return config
    output = model.get_output_embeddings()
    output_names = {name for name, module in model.named_modules() if module is output}
    names = {part.rpartition(".")[2] for options in parts.values() for part, _ in options if part not in output_names}
    resolved = copy.deepcopy(config)
    resolved.target_modules = names  # type: ignore[assignment]  # PEFT stores the spelt-out set itself
    return resolved


def _with_default_targets(config: LoraConfig, model_type: str) -> LoraConfig:
    """No ``target_modules``: PEFT's default for the model type (``q_proj``/``v_proj`` for Llama)."""
    if config.target_modules is not None:
        return config
    default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if default is None:
        raise LoraTargetError(
            f"LoraConfig sets no target_modules and PEFT has no default for model_type={model_type!r}"
        )
    resolved = copy.deepcopy(config)
    resolved.target_modules = default if isinstance(default, str) else set(default)  # type: ignore[assignment]
    return resolved


def adapts_output_layer(config: LoraConfig) -> bool:
    """Whether ``config`` adapts ``lm_head`` (matched as PEFT matches targets, regexes included) or
    keeps a trainable copy of it (``modules_to_save``): its output is then not the base weight's."""
    if "lm_head" in (config.modules_to_save or ()):
        return True
    return config.target_modules is not None and _matches(config, "lm_head")


def _matches(config: LoraConfig, name: str) -> bool:
    found = check_target_module_exists(config, name)
    return bool(found) and not isinstance(found, _ExcludedModule)


def _refuse_unadaptable(model: PreTrainedModel, config: LoraConfig, linears: dict[str, LinearLayer]) -> None:
    """A target naming a layer that is not ``nn.Linear`` (GPT-2's ``Conv1D``, an embedding) would be
    skipped in silence; PEFT would adapt it. Refuse instead."""
    for name, module in model.named_modules():
        skipped = name in linears or isinstance(module, ProjectionView) or list(module.children())
        if name and not skipped and _matches(config, name):
            raise UnsupportedLoraOptionError(
                f"target_modules matches {name}, a {type(module).__name__}: nemo_wrap adapts nn.Linear layers only"
            )
