"""``ShardedModelMixin``: what every model ``NeMoAutoModelForCausalLM`` returns does beyond its class.

A model nemo_wrap loads may be sharded across ranks, stored with fused projections, and wrapped by
torch (``FSDP…``/``DDP…`` class names). Three behaviours of a transformers model change with that,
and live here rather than in the init mixin (which knows nothing of files or ranks):

- ``save_pretrained`` writes one consolidated transformers checkpoint from any strategy, under
  transformers' keys (through the spec's adapter) and transformers' architecture name;
- ``generate`` keeps ranks in lockstep when the forward holds collectives;
- ``load_report`` carries the audit of the load, and ``model_spec`` the architecture's spec.

What the load learnt about the model lives in one typed attribute, ``nemo_state``
(:class:`~nemo_wrap.loading.model_state.ModelState`), set by the load pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from peft import LoraConfig
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_wrap.checkpoint.gather import SavingRanks, gather_full
from nemo_wrap.checkpoint.peft_adapter import save_peft_adapter
from nemo_wrap.checkpoint.save import DEFAULT_MAX_SHARD_SIZE, save_hf_checkpoint
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.pipeline.stage_model import held_tied_weights
from nemo_wrap.errors import UnsupportedSaveOptionError
from nemo_wrap.loading.model_state import ModelState, setup_of
from nemo_wrap.loading.provenance import LoadReport
from nemo_wrap.models.lora import LoraAdapters, is_lora_parameter, lora_settings
from nemo_wrap.models.lora.layers import adapted_layer
from nemo_wrap.models.lora.state_dict import MergedWeightsAdapter, adapter_file_keys
from nemo_wrap.models.spec import ModelSpec
from nemo_wrap.state_dict import StateDictAdapter, checkpoint_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ShardedModelMixin:
    """Mixed in first (see :func:`nemo_wrap.auto.classes.loadable_class`) over a class that has
    the init mixin: our own implementation or the ``NeMo<Name>`` wrapper of transformers' class."""

    model_spec: ClassVar[ModelSpec]
    hf_architecture: ClassVar[str]
    nemo_state: ModelState  # filled in by the load pipeline, step by step

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.nemo_state = ModelState()  # first: transformers' __init__ ties weights, which reads it
        super().__init__(*args, **kwargs)

    @property
    def load_report(self) -> LoadReport | None:
        """Where every parameter and buffer came from (the audit of ``from_pretrained``/``from_config``)."""
        return self.nemo_state.load_report

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """transformers' ties, less those LoRA's ``modules_to_save`` undid (PEFT's untied copy, which
        ``tie_weights`` must not tie back), and those a pipeline stage holds only one end of (a middle
        stage holds neither the embedding nor the head; tying them there would look for modules it lacks)."""
        tied = super().get_expanded_tied_weights_keys(all_submodels)  # type: ignore[misc]
        untied = self.nemo_state.untied
        tied = {t: s for t, s in tied.items() if untied.get(t) != s and untied.get(s) != t}  # either direction
        return tied if self.nemo_state.pipeline is None else held_tied_weights(self, tied)  # type: ignore[arg-type]

    def state_dict_adapter(self) -> StateDictAdapter:
        """Between this model's parameter names and transformers' checkpoint keys."""
        return self.model_spec.adapter(self)  # type: ignore[arg-type]

    def save_pretrained(
        self,
        save_directory: str | Path,
        is_main_process: bool = True,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        push_to_hub: bool = False,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        variant: str | None = None,
        token: str | bool | None = None,
        save_peft_format: bool = True,
        save_original_format: bool = True,
        distributed_checkpoint: bool = False,
        tokenizer: PreTrainedTokenizerBase | None = None,
        merge_adapters: bool = False,
        **kwargs: Any,
    ) -> None:
        """Write a consolidated transformers checkpoint; transformers' signature, plus ``tokenizer``.

        A model with LoRA adapters writes a PEFT adapter directory instead (the full adapter from
        every strategy), which ``PeftModel.from_pretrained`` loads over transformers' class; with
        ``merge_adapters=True``, a plain checkpoint whose adapted weights hold ``W + scaling · B @ A``.

        transformers' own method cannot serve here: it names ``type(self)`` (``NeMo…``, ``FSDP…``)
        as the architecture, would write our fused keys, and on rank 0 alone under a process group
        can hang the others. A sharded model is saved by every rank together (rank 0 writes,
        ``is_main_process`` is not needed); a process-local one by this process alone, or not at all
        when ``is_main_process`` is false. ``state_dict`` is written instead of the model's tensors.
        ``token`` and ``save_peft_format`` have nothing to act on here; options that cannot be
        honoured raise :class:`UnsupportedSaveOptionError`. See
        :func:`nemo_wrap.checkpoint.save.save_hf_checkpoint`.
        """
        _refuse_unsupported(push_to_hub, variant, save_original_format, distributed_checkpoint, kwargs)
        group = RankGroup.of(sharded=_is_sharded(self))
        if not group.collective and not is_main_process:
            return
        if self.nemo_state.lora_config is not None:
            save = {"max_shard_size": max_shard_size, "tokenizer": tokenizer}
            self._save_adapter(save_directory, group, merge_adapters, **save)
            return
        save_hf_checkpoint(
            self,  # type: ignore[arg-type]
            save_directory,
            architecture=self.hf_architecture,
            adapter=self.state_dict_adapter(),
            ranks=SavingRanks(group, self.nemo_state.pipeline),
            state_dict=state_dict,
            max_shard_size=max_shard_size,
            tokenizer=tokenizer,
        )

    def _save_adapter(self, save_directory: str | Path, group: RankGroup, merge_adapters: bool, **save: Any) -> None:
        """The whole LoRA adapter in PEFT's keys and format — or, with ``merge_adapters``, a plain
        transformers checkpoint whose adapted weights hold ``W + scaling · B @ A``."""
        distinct, _ = checkpoint_tensors(self)  # type: ignore[arg-type]
        lora = {name: t for name, t in distinct.items() if is_lora_parameter(name)}
        config = cast(LoraConfig, self.nemo_state.lora_config)
        if not merge_adapters:
            keys = adapter_file_keys(self, lora_settings(config), self.state_dict_adapter())  # type: ignore[arg-type]
            parameters = dict(self.named_parameters(remove_duplicate=False))  # type: ignore[attr-defined]
            adapter_tensors = {key: parameters[name] for name, key in keys.items()}
            save_peft_adapter(adapter_tensors, config, save_directory, group, self.nemo_state.pipeline)
            return
        _refuse_unmergeable_bias(self)
        if self.nemo_state.untied:  # a merged checkpoint of it would be an untied model under a tied config
            raise UnsupportedSaveOptionError(
                f"save_pretrained(merge_adapters=True): modules_to_save trained an untied copy of the tied "
                f"{sorted(self.nemo_state.untied)}, which nemo_wrap does not write merged; save the adapter "
                "(merge_adapters=False) and merge it with PEFT's merge_and_unload, or use ensure_weight_tying=True"
            )
        if self.nemo_state.pipeline is not None:
            raise UnsupportedSaveOptionError(
                "save_pretrained(merge_adapters=True) on a pipeline stage: merging needs every layer's base "
                "weights in one place; save the adapter (merge_adapters=False) and merge it after loading"
            )
        full = {name: gather_full(t) for name, t in lora.items()}  # every rank, in the same order
        merging = MergedWeightsAdapter(self.state_dict_adapter(), self, full)  # type: ignore[arg-type]
        save_hf_checkpoint(
            self,  # type: ignore[arg-type]
            save_directory,
            architecture=self.hf_architecture,
            adapter=merging,
            ranks=SavingRanks(group, self.nemo_state.pipeline),
            **save,
        )

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, kept in lockstep across ranks when sharding needs it.

        A model sharded by nemo_wrap across ranks (``nemo_state.setup``) runs collectives in
        every forward (FSDP all-gathers, tensor-parallel reductions, DDP buffer syncs), so a rank
        that meets its EOS early must keep stepping until every rank is done, or the others hang.
        transformers turns ``synced_gpus`` on only for its own FSDP; here it defaults to on for
        ours. An explicit ``synced_gpus=`` argument wins.
        """
        setup = self.nemo_state.setup
        if setup.is_collective and setup.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        return super().generate(*args, **kwargs)  # type: ignore[misc]


def _refuse_unmergeable_bias(model: object) -> None:
    """``lora_bias`` merges into the layer's bias; a layer without one cannot hold it (PEFT refuses too)."""
    modules = dict(model.named_modules()) if isinstance(model, nn.Module) else {}
    for name, adapters in modules.items():
        if isinstance(adapters, LoraAdapters) and any(p.lora_bias is not None for p in adapters.pairs.values()):
            layer = modules[adapted_layer(name)]
            if getattr(layer, "bias", None) is None:
                raise UnsupportedSaveOptionError(
                    f"save_pretrained(merge_adapters=True): {adapted_layer(name)} has no bias to merge lora_bias into; "
                    "save the adapter (merge_adapters=False) instead"
                )


def no_cache_while_training(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook: in train mode, no KV cache unless the caller asks for one.

    transformers creates a cache whenever ``use_cache`` (true in most configs), and with a cache
    present its mask builder stops detecting packed rows from ``position_ids``: a packed row then
    attends across its examples (logits off by 0.46 on a tiny Llama). Training never reads a cache.
    """
    if module.training and kwargs.get("use_cache") is None:
        kwargs["use_cache"] = False
    return args, kwargs


def _is_sharded(model: object) -> bool:
    """Sharded by nemo_wrap, or holding DTensors (parallelized by the caller): saving is collective."""
    if setup_of(model).is_collective:
        return True
    parameters = model.parameters() if isinstance(model, nn.Module) else ()
    return any(isinstance(parameter, DTensor) for parameter in parameters)


def _refuse_unsupported(
    push_to_hub: bool, variant: str | None, save_original_format: bool, distributed_checkpoint: bool, kwargs: dict
) -> None:
    """Raise for transformers' options with no meaning here, naming each; accept the harmless ones."""
    refused = {
        "push_to_hub=True": "no hub upload here: push the saved directory with huggingface_hub",
        "variant": "weights are written under transformers' default file names",
        "save_original_format=False": "the saved checkpoint is always in transformers' original layout",
        "distributed_checkpoint=True": "use nemo_wrap.save_checkpoint for a sharded, resumable checkpoint",
        "safe_serialization=False": "only safetensors are written",
        "save_function": "files are written by nemo_wrap's atomic writer",
    }
    given = {
        "push_to_hub=True": push_to_hub,
        "variant": variant is not None,
        "save_original_format=False": not save_original_format,
        "distributed_checkpoint=True": distributed_checkpoint,
        "safe_serialization=False": kwargs.pop("safe_serialization", True) is False,
        "save_function": kwargs.pop("save_function", None) is not None,
    }
    problems = [f"{option} ({refused[option]})" for option, present in given.items() if present]
    problems += [f"{name} (not a save_pretrained argument)" for name in sorted(kwargs)]
    if problems:
        raise UnsupportedSaveOptionError(f"save_pretrained: cannot honour {'; '.join(problems)}")
