"""PEFT's ``modules_to_save``: whole modules trained beside the adapters, saved in the adapter file.

PEFT wraps each module whose name ends with an entry of ``modules_to_save`` in a trainable copy and
saves that copy under the module's own keys (``base_model.model.lm_head.weight``). Here the module's
own parameters are unfrozen — no copy, so no second lm_head in memory — and written to, and read
back from, the adapter file under PEFT's keys (transformers' names, through the state-dict adapter).

A module that shares a tied weight (an lm_head tied to the embedding) can only be trained as that
one tensor: that is PEFT's ``ensure_weight_tying=True`` (which saves it under both names). Without
it PEFT trains an untied copy, which a tied parameter cannot become, so that is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_wrap.errors import LoraTargetError, UnsupportedLoraOptionError, summarize
from nemo_wrap.models.lora.peft_views import ProjectionView
from nemo_wrap.models.lora.settings import LoraSettings
from nemo_wrap.state_dict import StateDictAdapter, checkpoint_tensors


def modules_to_save_keys(model: nn.Module, settings: LoraSettings, base: StateDictAdapter) -> dict[str, str]:
    """Every parameter of the modules to save, our name → PEFT's key in the adapter file (each
    name of a tied tensor included). Raises when an entry matches nothing, a fused projection, or
    a tied module without ``ensure_weight_tying``."""
    if not settings.modules_to_save:
        return {}
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
    names = [f"{module_name}.{name}" for module_name, module in modules for name, _ in module.named_parameters()]
    names += _tie_partners(model, names, settings.ensure_weight_tying)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    return {name: _peft_key(name, tuple(parameters[name].shape), base) for name in dict.fromkeys(names)}


def unfreeze(model: nn.Module, keys: dict[str, str]) -> None:
    """Make the parameters named in ``keys`` trainable (after :func:`add_lora` froze the base)."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name in keys:
        parameters[name].requires_grad_(True)


def _tie_partners(model: nn.Module, names: list[str], ensure_weight_tying: bool) -> list[str]:
    """The other names of tied tensors among ``names`` (saved under every name, as PEFT does with
    ``ensure_weight_tying``); refused without that option."""
    _, tied = checkpoint_tensors(model)
    pairs = [(target, source) for target, source in tied.items() if target in names or source in names]
    partners = [name for pair in pairs for name in pair if name not in names]
    if pairs and not ensure_weight_tying:
        shared = sorted({name for pair in pairs for name in pair} & set(names))
        raise UnsupportedLoraOptionError(
            f"modules_to_save trains {shared}, tied to {sorted(partners)}: PEFT would train an untied copy. "
            "Pass ensure_weight_tying=True to train the tied weight as one tensor (saved under both names)"
        )
    return partners


def _peft_key(name: str, shape: tuple[int, ...], base: StateDictAdapter) -> str:
    """PEFT's adapter-file key of one of our parameters: transformers' key under ``base_model.model.``.
    A tie target (``lm_head.weight``), which checkpoints omit, is named as it is."""
    hf_keys = list(base.to_hf({name: torch.empty(shape, device="meta")})) or [name]
    if len(hf_keys) != 1:
        raise UnsupportedLoraOptionError(
            f"modules_to_save: {name} holds several transformers tensors {sorted(hf_keys)}"
        )
    return f"base_model.model.{hf_keys[0]}"
