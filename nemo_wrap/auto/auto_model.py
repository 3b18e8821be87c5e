"""``NeMoAutoModelForCausalLM``: the user-facing entry point, one audited pipeline.

``from_pretrained`` reads top-down: open the checkpoint and its config → resolve the architecture
(spec and class) → compute the plan → execute it (:class:`LoadPipeline`) → return the model.
``from_config`` is the same pipeline with no checkpoint; ``plan`` stops after the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig
from transformers import AutoConfig, BitsAndBytesConfig, PretrainedConfig, PreTrainedModel

from nemo_wrap.auto.classes import loadable_class
from nemo_wrap.auto.lora_steps import LoraRequest
from nemo_wrap.auto.pipeline import LoadPipeline
from nemo_wrap.checkpoint.locate import Checkpoint, open_checkpoint, require_inside, resolve_checkpoint_directory
from nemo_wrap.checkpoint.peft_adapter import open_adapter
from nemo_wrap.checkpoint.strict_json import read_json_file
from nemo_wrap.distributed.collectives import RankGroup, collective_device
from nemo_wrap.distributed.hardware import fast_matmul_dtypes
from nemo_wrap.distributed.precision import Precision, PrecisionName
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import (
    CheckpointNotFoundError,
    InvalidSetupError,
    UnsupportedModelError,
)
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import LoadPlan
from nemo_wrap.loading.read import checkpoint_shapes
from nemo_wrap.loading.resolve import CheckpointFacts, LoadRequest, Machine, resolve_load_plan
from nemo_wrap.models.registry import ModelSource, resolve_model_source

_MAX_CONFIG_BYTES = 16 * 2**20  # configs are kilobytes; a few MB with large label maps


class NeMoAutoModelForCausalLM:
    """Builds causal LMs whose every parameter provably holds the checkpoint, under any strategy."""

    def __init__(self) -> None:
        raise TypeError("NeMoAutoModelForCausalLM is a factory: use from_pretrained(...) or from_config(...)")

    @classmethod
    def plan(
        cls,
        path_or_config: str | Path | PretrainedConfig,
        distributed_setup: DistributedSetup | None = None,
        force_hf: bool = False,
        allow_pickle: bool = False,
        precision: Precision | PrecisionName | None = None,
        dtype: torch.dtype | str | None = None,
        compile: bool = False,
        quantization_config: BitsAndBytesConfig | None = None,
        options: LoadOptions | None = None,
    ) -> LoadPlan:
        """The load plan for a checkpoint directory (or a config: no checkpoint), reading no weights.

        Raises what ``from_pretrained`` / ``from_config`` would raise before reading weights (a
        config that cannot be built, tensor parallel the model cannot take, checkpoint keys that
        cannot be mapped), with the same error. Only the checkpoint's headers are read. ``options``
        is the typed form of the keywords (:class:`LoadOptions`), for a request built elsewhere.
        """
        options = _options(
            options,
            force_hf=force_hf,
            allow_pickle=allow_pickle,
            precision=precision,
            dtype=dtype,
            compile=compile,
            quantization_config=quantization_config,
        )
        setup = DistributedSetup.given(distributed_setup)
        if isinstance(path_or_config, PretrainedConfig):
            return _resolve(path_or_config, setup, options, None).plan
        config, checkpoint = _open(path_or_config, options, RankGroup.local())
        return _resolve(config, setup, options, checkpoint).plan

    @classmethod
    def model_class(cls, config: PretrainedConfig, force_hf: bool = False) -> type[PreTrainedModel]:
        """The class ``from_pretrained``/``from_config`` build for ``config`` (nothing is built)."""
        return loadable_class(resolve_model_source(config, force_hf))

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        distributed_setup: DistributedSetup | None = None,
        dtype: torch.dtype | str | None = None,
        strict: bool = True,
        verify: bool = False,
        force_hf: bool = False,
        allow_pickle: bool = False,
        seed: int | None = None,
        peft_config: LoraConfig | None = None,
        adapter: str | Path | None = None,
        precision: Precision | PrecisionName | None = None,
        compile: bool = False,
        quantization_config: BitsAndBytesConfig | None = None,
        options: LoadOptions | None = None,
        **config_overrides: Any,
    ) -> PreTrainedModel:
        """Load ``path`` (a checkpoint directory or hub id) sharded as ``distributed_setup`` says.

        ``distributed_setup=None`` loads into this process alone and runs no collective, whatever
        process group exists (so rank 0 may load a model by itself). Each keyword is the
        :class:`LoadOptions` field of its name, documented there (dtype, strict
        missing/unexpected-weight errors, verify, LoRA via ``peft_config`` or ``adapter``, precision,
        compile, 4-bit ``quantization_config``); ``options`` is the same request as one typed object,
        instead of the keywords. Other keywords override config attributes. The model carries
        ``model.load_report``; ``plan()`` shows what a load will do without reading a weight.
        """
        options = _options(
            options,
            dtype=dtype,
            strict=strict,
            verify=verify,
            force_hf=force_hf,
            allow_pickle=allow_pickle,
            seed=seed,
            peft_config=peft_config,
            adapter=adapter,
            precision=precision,
            compile=compile,
            quantization_config=quantization_config,
            config_overrides=tuple(config_overrides.items()),
        )
        setup = DistributedSetup.given(distributed_setup)
        group = setup.rank_group()
        config, checkpoint = group.on_every_rank("opening the checkpoint", lambda: _open(path, options, group))
        lora = group.on_every_rank("opening the adapter", lambda: _lora_request(options))
        request = _resolve(config, setup, options, checkpoint)
        return LoadPipeline(request.plan, request.source, config, options, checkpoint, lora).run()

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig,
        distributed_setup: DistributedSetup | None = None,
        seed: int | None = None,
        dtype: torch.dtype | str | None = None,
        force_hf: bool = False,
        precision: Precision | PrecisionName | None = None,
        compile: bool = False,
        options: LoadOptions | None = None,
    ) -> PreTrainedModel:
        """A freshly initialized model, sharded as ``distributed_setup`` says (one process if ``None``).

        ``seed`` fixes the init (default: rank 0's ``torch.initial_seed()``, shared with all ranks);
        the full weights are the same for every strategy and world size. ``dtype="auto"`` means the
        config's dtype, float32 when it names none; ``dtype=None`` the same, except a 16-bit dtype
        the device does not multiply fast becomes float32 (as in :meth:`from_pretrained`); ``precision``,
        ``compile`` and ``options`` as in :meth:`from_pretrained`.
        """
        options = _options(options, seed=seed, dtype=dtype, force_hf=force_hf, precision=precision, compile=compile)
        request = _resolve(config, DistributedSetup.given(distributed_setup), options, None)
        return LoadPipeline(request.plan, request.source, config, options, lora=_lora_request(options)).run()


def dry_run_pipeline(
    path_or_config: str | Path | PretrainedConfig, setup: DistributedSetup, options: LoadOptions
) -> LoadPipeline:
    """The pipeline ``from_pretrained`` (a path) or ``from_config`` (a config) would run, resolved
    from the config and the checkpoint's headers only, for the memory prediction's dry run: it
    performs the steps that allocate storage (:meth:`LoadPipeline.perform`), not the read."""
    if isinstance(path_or_config, PretrainedConfig):
        request = _resolve(path_or_config, setup, options, None)
        return LoadPipeline(request.plan, request.source, path_or_config, options, lora=_lora_request(options))
    config, checkpoint = _open(path_or_config, options, RankGroup.local())
    request = _resolve(config, setup, options, checkpoint)
    return LoadPipeline(request.plan, request.source, config, options, checkpoint, _lora_request(options))


def _options(options: LoadOptions | None, **keywords: Any) -> LoadOptions:
    """The one place a request's keywords become its :class:`LoadOptions`, each by its field's name:
    ``options`` when given (then the keywords must be left at their defaults), else the keywords'."""
    if options is None:
        return LoadOptions(**keywords)
    if LoadOptions(**keywords) != LoadOptions():
        raise InvalidSetupError("pass the load's options either as keywords or as options=LoadOptions(...), not both")
    return options


@dataclass(frozen=True)
class _Resolved:
    """A request and the plan resolved from it."""

    request: LoadRequest
    plan: LoadPlan

    @property
    def source(self) -> ModelSource:
        return self.request.source


def _resolve(
    config: PretrainedConfig, setup: DistributedSetup, options: LoadOptions, checkpoint: Checkpoint | None
) -> _Resolved:
    """Gather what the decision reads (the class for ``config``, the checkpoint's headers, this
    machine's facts) and resolve the plan from it."""
    facts = None
    if checkpoint is not None:
        floating = [e.dtype for e in checkpoint.entries.values() if e.dtype.is_floating_point]
        floating += [t.dtype for t in (checkpoint.pickle_tensors or {}).values() if t.is_floating_point()]
        facts = CheckpointFacts(tuple(checkpoint_shapes(checkpoint)), tuple(floating))
    device_type = collective_device().type
    machine = Machine(device_type, fast_matmul_dtypes(device_type))
    source = resolve_model_source(config, force_hf=options.force_hf)
    request = LoadRequest(source, config, setup, options, facts, machine)
    return _Resolved(request, resolve_load_plan(request))


def _lora_request(options: LoadOptions) -> LoraRequest | None:
    """New adapters from ``peft_config``, or the adapter directory ``adapter`` (never both: see LoadOptions)."""
    if options.adapter is not None:
        config, adapter_file = open_adapter(options.adapter)
        return LoraRequest(config, adapter_file)
    return None if options.peft_config is None else LoraRequest(options.peft_config)


def _open(path: str | Path, options: LoadOptions, group: RankGroup) -> tuple[PretrainedConfig, Checkpoint]:
    directory = resolve_checkpoint_directory(path, group)
    return _load_config(directory, options.overrides), open_checkpoint(directory, allow_pickle=options.allow_pickle)


def _load_config(directory: Path, overrides: dict[str, Any]) -> PretrainedConfig:
    """The checkpoint's config with ``overrides`` applied; a keyword that is no config attribute
    (a misspelt argument, say) raises instead of vanishing."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointNotFoundError(f"{directory}: no config.json")
    require_inside(directory, "config.json")
    read_json_file(config_path, "config", _MAX_CONFIG_BYTES)  # strict and bounded, before transformers parses it
    try:
        config, unused = AutoConfig.from_pretrained(
            directory, trust_remote_code=False, return_unused_kwargs=True, **overrides
        )
    except Exception as error:  # the JSON is valid (read above): transformers refuses a value in it
        raise UnsupportedModelError(
            f"{config_path}: transformers refuses this config ({type(error).__name__}: {str(error)[:300]})"
        ) from error
    if unused:
        raise InvalidSetupError(
            f"from_pretrained: unknown keyword argument(s) {sorted(unused)}: neither an argument of "
            f"from_pretrained nor an attribute of {type(config).__name__} ({config_path})"
        )
    return config
