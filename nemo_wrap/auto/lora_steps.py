"""The load pipeline's LoRA steps: add adapters before sharding, read an adapter file after the base.

Kept apart from :mod:`nemo_wrap.auto.pipeline` so the base load reads the same with or without
LoRA; the pipeline calls these when its plan has adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from peft import LoraConfig
from transformers import PreTrainedModel

from nemo_wrap.checkpoint.locate import Checkpoint
from nemo_wrap.checkpoint.safetensors_file import BlockReader
from nemo_wrap.errors import UnsupportedLoraOptionError
from nemo_wrap.loading.model_state import HasModelState
from nemo_wrap.loading.provenance import Initialized, Missing, Provenance
from nemo_wrap.loading.read import read_into_model
from nemo_wrap.models.lora import (
    add_lora,
    add_projection_views,
    find_lora_targets,
    fused_parts,
    is_lora_parameter,
    lora_settings,
)
from nemo_wrap.models.lora.modules_to_save import (
    fill_untied_copies,
    modules_to_save_keys,
    unfreeze,
    untie_modules_to_save,
)
from nemo_wrap.models.lora.settings import LoraSettings
from nemo_wrap.models.lora.state_dict import AdapterFileAdapter, adapter_file_keys
from nemo_wrap.models.registry import ModelSource

NEW_ADAPTER_RULE = "LoraPair.init_own_parameters (PEFT's init: lora_A uniform in ±1/sqrt(in), lora_B zero; seeded)"
NEW_MAGNITUDE_RULE = "dora.initialize_magnitudes (PEFT's init: the row norms of the adapted weight)"


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA a load adds: new adapters per ``config``, or the adapter in ``adapter_file``."""

    config: LoraConfig
    adapter_file: Checkpoint | None = None


def add_adapters(model: PreTrainedModel, source: ModelSource, request: LoraRequest, base_name: str) -> LoraConfig:
    """Attach the adapters ``request`` asks for (on meta, before sharding) and freeze the base but
    the modules to save (a tied one untied first, as PEFT does without ``ensure_weight_tying``);
    return their config as PEFT saves it (``"all-linear"`` spelt out).

    Our fused classes are matched through their state-dict adapter (which rows are which
    transformers projection); transformers' own classes by their module names as they are.
    """
    base_adapter = source.spec.adapter(model) if source.is_custom else None
    resolved, targets = find_lora_targets(model, request.config, base_adapter)
    settings = lora_settings(request.config)
    add_lora(model, targets, settings)
    _refuse_untying_across_stages(model, settings)
    cast(HasModelState, model).nemo_state.untied = untie_modules_to_save(model, settings)
    unfreeze(model, modules_to_save_keys(model, settings, source.spec.adapter(model)))
    resolved.base_model_name_or_path = resolved.base_model_name_or_path or base_name
    resolved.inference_mode = False
    return resolved


def _refuse_untying_across_stages(model: PreTrainedModel, settings: LoraSettings) -> None:
    """Under pipeline parallelism a tied embedding is one tensor held by the first and the last
    stage, which sum their gradients for it; PEFT's untied copy of one end is not implemented
    there. Decided from module names, which every stage has (a stage's stand-ins keep them), so
    every stage raises alike."""
    pipeline = cast(HasModelState, model).nemo_state.pipeline
    if pipeline is None or pipeline.tie_group is None or settings.ensure_weight_tying:
        return
    ends = {name.rpartition(".")[0] for pair in (model._tied_weights_keys or {}).items() for name in pair}
    named = sorted(end for end in ends if any(end.endswith(entry) for entry in settings.modules_to_save))
    if named:
        raise UnsupportedLoraOptionError(
            f"modules_to_save names {named}, an end of the tied embedding, without ensure_weight_tying: PEFT would "
            "train an untied copy, which pipeline stages (that hold the tied tensor on the first and the last stage) "
            "do not implement. Pass ensure_weight_tying=True to train the tied weight as one tensor"
        )


def expose_projections_to_peft(model: PreTrainedModel, source: ModelSource) -> None:
    """Name transformers' projections inside our fused layers, so that PEFT's own
    ``get_peft_model`` (TRL's ``peft_config=``) adapts them (see :mod:`nemo_wrap.models.lora.peft_views`).
    transformers' own classes already have those names."""
    if source.is_custom:
        add_projection_views(model, fused_parts(model, source.spec.adapter(model)))


def adapter_keys(model: PreTrainedModel, source: ModelSource, config: LoraConfig) -> dict[str, str]:
    """Every tensor of ``model``'s adapter file, our name → PEFT's key (LoRA pairs, modules to save)."""
    return adapter_file_keys(model, lora_settings(config), source.spec.adapter(model))


def read_adapter_file(
    model: PreTrainedModel, adapter_file: Checkpoint, keys: dict[str, str], show_progress: bool
) -> tuple[dict[str, Provenance], set[str], int]:
    """Each rank reads its slices of the adapter's tensors (``keys``) from the adapter file: their
    provenance, the file's keys used (a tied tensor's other key too), and the bytes read."""
    with BlockReader() as reader:
        provenance, used = read_into_model(model, adapter_file, reader, AdapterFileAdapter(keys), show_progress)
        read = {name: found for name, found in provenance.items() if name in keys}
        used = {keys.get(name, name) for name in used}  # a tie target is counted under its name: its key
        return read, used, sum(reader.bytes_read.values())


def new_adapter_provenance(provenance: dict[str, Provenance], names: list[str]) -> None:
    """New adapters are initialized by their own rule, which is why they may be absent from files."""
    for name in names:
        if is_lora_parameter(name) and (provenance.get(name) is None or isinstance(provenance[name], Missing)):
            rule = NEW_MAGNITUDE_RULE if name.endswith(".lora_magnitude") else NEW_ADAPTER_RULE
            provenance[name] = Initialized(rule, "a new LoRA adapter (peft_config)")


def start_untied_copies(model: PreTrainedModel, provenance: dict[str, Provenance], loaded: set[str]) -> None:
    """An untied copy (``modules_to_save`` of a tied module) that no file filled starts as its
    source, as PEFT's copy does: after initialization, when the source holds its values."""
    untied = cast(HasModelState, model).nemo_state.untied
    for name in fill_untied_copies(model, untied, loaded):
        why = "absent from every file read; PEFT's modules_to_save copy starts as the tied module it copies"
        provenance[name] = Initialized(f"a copy of {untied[name]}", why)
