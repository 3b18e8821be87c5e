"""PEFT's ``modules_to_save``: whole modules trained beside the adapters, saved in the adapter file.

PEFT wraps each module whose name ends with an entry of ``modules_to_save`` in a trainable copy and
saves that copy under the module's own keys (``base_model.model.lm_head.weight``). Here the module's
own parameters are unfrozen — no copy, so no second lm_head in memory — and written to, and read
back from, the adapter file under PEFT's keys (transformers' names, through the state-dict adapter).

A module that shares a tied weight (an lm_head tied to the embedding) is the one case that needs a
copy. With ``ensure_weight_tying=True`` PEFT trains the tied weight as one tensor (saved under both
names), and so does nemo_wrap: the tied parameter is unfrozen. Without it — PEFT's default — PEFT
trains an untied copy of the module and warns, and the other end of the tie stays frozen with the
base; unfreezing the tied parameter would train both ends. So :func:`untie_modules_to_save` gives
the tie's target a parameter of its own, on meta before sharding (every strategy then shards it as
any other parameter), read from its source's checkpoint tensor (:func:`fill_untied_copies` where no
file has it): PEFT's copy. Whichever end the entry names trains; the adapter file holds it under its
own key alone, as PEFT's does, so adapters move both ways. transformers' ``tie_weights`` must leave
such a pair apart (the loaded model's ``nemo_state.untied`` names it).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from nemo_wrap.errors import LoraTargetError, TiedWeightLayoutError, UnsupportedLoraOptionError, summarize
from nemo_wrap.initialization.geometry import local_shard
from nemo_wrap.models.lora.peft_views import ProjectionView
from nemo_wrap.models.lora.settings import LoraSettings
from nemo_wrap.state_dict import StateDictAdapter, checkpoint_tensors


def modules_to_save_keys(model: nn.Module, settings: LoraSettings, base: StateDictAdapter) -> dict[str, str]:
    """Every parameter of the modules to save, our name → PEFT's key in the adapter file (each
    name of a tied tensor included). Raises when an entry matches nothing or a fused projection."""
    if not settings.modules_to_save:
        return {}
    names = _parameter_names(model, settings)
    names += _tie_partners(model, names)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    return {name: _peft_key(name, tuple(parameters[name].shape), base) for name in dict.fromkeys(names)}


def unfreeze(model: nn.Module, keys: dict[str, str]) -> None:
    """Make the parameters named in ``keys`` trainable (after :func:`add_lora` froze the base)."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name in keys:
        parameters[name].requires_grad_(True)


def untie_modules_to_save(model: nn.Module, settings: LoraSettings) -> dict[str, str]:
    """Without ``ensure_weight_tying``, give each tie that a module to save shares two parameters
    (see the module doc), warning as PEFT does; return the ties so undone, target → source.

    Call on meta, before sharding and materializing; transformers' ``tie_weights`` must then leave
    these pairs apart, and the target is read from its source's checkpoint tensor. The new
    parameter is frozen: :func:`unfreeze` trains whichever end the user named.
    """
    if settings.ensure_weight_tying or not settings.modules_to_save:
        return {}
    names = _parameter_names(model, settings)
    _, tied = checkpoint_tensors(model)
    untied = {target: source for target, source in tied.items() if target in names or source in names}
    for target, source in untied.items():
        module, _, attribute = target.rpartition(".")
        copy = nn.Parameter(torch.empty_like(model.get_parameter(source)), requires_grad=False)
        setattr(model.get_submodule(module), attribute, copy)
    if untied:
        _warn_untied(untied, names)
    return untied


def fill_untied_copies(model: nn.Module, untied: dict[str, str], loaded: set[str]) -> list[str]:
    """Give each untied target that no file filled (``from_config``) its source's values, as PEFT's
    copy starts as the module it copies; the targets so set. Both ends of a tie are sharded alike
    (they were one tensor), so each rank copies its own shard."""
    filled = [target for target in untied if target not in loaded]
    with torch.no_grad():
        for target in filled:
            copy, source = model.get_parameter(target), model.get_parameter(untied[target])
            if getattr(copy, "placements", None) != getattr(source, "placements", None):
                raise TiedWeightLayoutError(f"the untied copy {target} is sharded unlike its source {untied[target]}")
            local_shard(copy).copy_(local_shard(source))
    return filled


def _warn_untied(untied: dict[str, str], names: list[str]) -> None:
    """PEFT warns that the tie is not kept; ours also says what trains and how to keep the tie."""
    ends = {*untied, *untied.values()}
    trained, frozen = sorted(ends & set(names)), sorted(ends - set(names))
    warnings.warn(
        f"modules_to_save trains {trained}, tied weight(s), as an untied copy"
        + (f" ({frozen} stays frozen with the base)" if frozen else "")
        + ": PEFT's behaviour without ensure_weight_tying. Pass LoraConfig(ensure_weight_tying=True) to keep "
        "the tie and train the one tied tensor",
        UserWarning,
        stacklevel=3,
    )


def _parameter_names(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The parameters of every module whose name ends with an entry of ``modules_to_save``; raises
    when an entry matches nothing or names a projection inside one of our fused layers."""
    modules = [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if name and any(name.endswith(entry) for entry in settings.modules_to_save)
    ]
    if not modules:
        raise LoraTargetError(
            f"LoraConfig modules_to_save={list(settings.modules_to_save)} matches no module of {type(model).__name__}"
        )
    fused = [name for name, module in modules if isinstance(module, ProjectionView)]
    if fused:
        raise UnsupportedLoraOptionError(
            f"modules_to_save names {summarize(fused)}, part of a fused layer of {type(model).__name__}: "
            "save the whole fused layer, or load with force_hf=True"
        )
    return [f"{module_name}.{name}" for module_name, module in modules for name, _ in module.named_parameters()]


def _tie_partners(model: nn.Module, names: list[str]) -> list[str]:
    """The other names of tied tensors among ``names``: a tie still there is one PEFT's
    ``ensure_weight_tying`` keeps, and saves under every name (without it the tie was untied)."""
    _, tied = checkpoint_tensors(model)
    pairs = [(target, source) for target, source in tied.items() if target in names or source in names]
    return [name for pair in pairs for name in pair if name not in names]


def _peft_key(name: str, shape: tuple[int, ...], base: StateDictAdapter) -> str:
    """PEFT's adapter-file key of one of our parameters: transformers' key under ``base_model.model.``.
    A tie target (``lm_head.weight``), which checkpoints omit, is named as it is."""
    hf_keys = list(base.to_hf({name: torch.empty(shape, device="meta")})) or [name]
    if len(hf_keys) != 1:
        raise UnsupportedLoraOptionError(
            f"modules_to_save: {name} holds several transformers tensors {sorted(hf_keys)}"
        )
    return f"base_model.model.{hf_keys[0]}"
