"""The one load decision: ``(model source, config, setup, options, checkpoint facts) → LoadPlan``.

Every choice a load makes and every refusal it can make before touching a weight is made here, by
:func:`resolve_load_plan`, a pure function: no I/O, no process group, no model. Its inputs are a
:class:`LoadRequest` (frozen data, the same on every rank of a host), so every rank computes the
same plan with no collective, ``plan()`` refuses exactly what a load refuses, with the same error,
and the executor (:class:`nemo_wrap.auto.pipeline.LoadPipeline`) only performs the plan's steps.

What it decides, in the order it refuses: the config can be built and what the load combines
composes (:mod:`nemo_wrap.distributed.combinations`, the one table of that); the checkpoint's keys
fit the config and can be mapped; the family takes the pipeline, context, expert and tensor
parallelism asked for (the tensor-parallel plan, experts dropped from it under expert parallel);
the parameters' dtype and the precision; the pipeline stages; LoRA options; 4-bit settings; and
then the steps, in the order they run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from nemo_wrap.distributed.combinations import Feature, refuse_unsupported, setup_arguments
from nemo_wrap.distributed.expert_parallel import ExpertLayout, expert_layout
from nemo_wrap.distributed.pipeline import StageLayout, stage_layouts
from nemo_wrap.distributed.precision import (
    DtypeChoice,
    Precision,
    PrecisionPlan,
    default_parameter_dtype,
    parameter_dtype,
    precision_plan,
)
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.distributed.tensor_parallel import TensorParallelPlan, check_tensor_parallel_supported
from nemo_wrap.errors import InvalidSetupError, UnsupportedSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.plan import DEFAULT_CHUNK_TOKENS, Adapters, LoadPlan, LossPath, LossPlan, Step
from nemo_wrap.models.config_checks import check_config_sizes, check_layer_count
from nemo_wrap.models.head import head_transform
from nemo_wrap.models.lora import adapts_output_layer, lora_settings
from nemo_wrap.models.parallel_support import check_context_parallel_supported, check_pipelinable
from nemo_wrap.models.quantized.settings import QuantizationSettings, quantization_settings
from nemo_wrap.models.registry import ModelSource

# The dtypes a model can be built and trained in (torch's default dtype takes only these).
PARAMETER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the decision reads of a checkpoint: its headers only, never a weight."""

    keys: tuple[str, ...]
    floating_dtypes: tuple[torch.dtype, ...]  # one per floating-point tensor: the majority is "its dtype"


@dataclass(frozen=True)
class Machine:
    """The facts of the machine a plan is made on that the decision reads (the same on every rank
    of a host): the device type and the dtypes it multiplies fast."""

    device_type: str
    fast_dtypes: frozenset[torch.dtype]


@dataclass(frozen=True)
class LoadRequest:
    """Everything a load decision depends on. ``checkpoint`` is ``None`` for ``from_config``."""

    source: ModelSource
    config: PretrainedConfig
    setup: DistributedSetup
    options: LoadOptions
    checkpoint: CheckpointFacts | None
    machine: Machine


def resolve_load_plan(request: LoadRequest) -> LoadPlan:
    """The plan for ``request``, or the specific error naming what cannot be loaded and the way out."""
    source, setup, options = request.source, request.setup, request.options
    experts = _refuse_what_cannot_load(request)
    tp_plan = _tensor_parallel_plan(request, experts)
    precision = _precision(request)
    stages = _pipeline_stages(request.config, setup)
    if options.peft_config is not None:
        lora_settings(options.peft_config)  # refuses what it does not implement, before anything is built
    has_checkpoint = request.checkpoint is not None
    quantization = None if options.quantization_config is None else quantization_settings(options.quantization_config)
    adapters = _adapters(options)
    return LoadPlan(
        model_class=source.model_class.__name__,
        is_custom=source.is_custom,
        source_reason=source.reason,
        setup=setup,
        has_checkpoint=has_checkpoint,
        steps=_ordered_steps(setup, has_checkpoint, adapters, quantization is not None, options.compile, bool(stages)),
        precision=precision,
        loss=_loss(request, quantization, adapters),
        key_mapping=source.spec.key_mapping(source.architecture, request.config.model_type),
        adapters=adapters,
        stages=stages,
        experts=experts,
        quantization=quantization,
        tp_plan=tp_plan,
    )


def _refuse_what_cannot_load(request: LoadRequest) -> ExpertLayout | None:
    """The refusals that need neither a dtype nor options; the expert layout (None without ep)."""
    source, config, setup = request.source, request.config, request.setup
    check_config_sizes(config)
    refuse_unsupported(source.model_class.__name__, _load_arguments(request))
    if request.checkpoint is not None:
        check_layer_count(config, source.model_class, request.checkpoint.keys)
        source.spec.check_checkpoint_keys(source.architecture, config.model_type)
    if setup.degrees.pp > 1:
        check_pipelinable(config.model_type, source.model_class.__name__)
    if setup.degrees.cp > 1:
        check_context_parallel_supported(config, source.is_custom, source.model_class.__name__)
    return expert_layout(config, source.model_class, setup.degrees)


def _tensor_parallel_plan(request: LoadRequest, experts: ExpertLayout | None) -> TensorParallelPlan | None:
    """The spec's tensor-parallel plan (None without tensor parallel), experts left whole under
    expert parallel; refuses a model the tp degree cannot split."""
    setup, source = request.setup, request.source
    if not setup.uses_tensor_parallel:
        return None
    if setup.sequence_parallel and source.spec.sequence_parallel_plan is None:
        raise UnsupportedSetupError(
            f"{source.model_class.__name__} has no sequence-parallel plan (nemo_wrap's fused Llama, Qwen2 "
            "and Qwen3 have one): use sequence_parallel=False"
        )
    plan = source.spec.parallel_plan(setup.sequence_parallel)
    if plan is not None and experts is not None:
        plan = experts.without_expert_entries(plan)
    check_tensor_parallel_supported(plan, request.config, setup.tp_size, source.model_class.__name__)
    return plan


def _precision(request: LoadRequest) -> PrecisionPlan:
    setup = request.setup
    parameters = _parameter_dtype(request)
    return precision_plan(
        request.options.precision,
        parameters.dtype,
        setup.strategy,
        setup.dp_size,
        setup.options,
        parameters.reason,
    )


def _parameter_dtype(request: LoadRequest) -> DtypeChoice:
    """The parameters' dtype: ``precision``'s (an explicit ``dtype`` must agree), else ``dtype``'s;
    ``"auto"`` is the checkpoint's, and with neither given it is the machine's fast choice."""
    dtype = request.options.dtype
    explicit = None if dtype is None or dtype == "auto" else _resolve_dtype(dtype, request)
    chosen = parameter_dtype(request.options.precision, explicit)
    if chosen is not None:
        return DtypeChoice(chosen, "dtype given")
    stored = _resolve_dtype(dtype, request)
    if dtype == "auto":
        return DtypeChoice(stored, "dtype='auto': the weights' dtype")
    machine = request.machine
    return default_parameter_dtype(stored, machine.fast_dtypes, machine.device_type)


def _resolve_dtype(dtype: torch.dtype | str | None, request: LoadRequest) -> torch.dtype:
    """``None``/``"auto"``: the checkpoint's floating dtype (else the config's, else float32)."""
    if dtype is None or dtype == "auto":
        floating = list(request.checkpoint.floating_dtypes) if request.checkpoint is not None else []
        configured = getattr(request.config, "dtype", None) or torch.float32
        dtype = max(set(floating), key=floating.count) if floating else configured
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidSetupError(f"dtype={dtype!r} is not a torch dtype name")
        dtype = resolved
    if dtype not in PARAMETER_DTYPES:
        raise InvalidSetupError(
            f"dtype={dtype!r}: parameters are built in one of {[str(d) for d in PARAMETER_DTYPES]} "
            "(float8 and integer weights need a quantization library), or pass 'auto' or None"
        )
    return dtype


def _pipeline_stages(config: PretrainedConfig, setup: DistributedSetup) -> tuple[StageLayout, ...]:
    """The pipeline stages' layouts (none without pipeline parallel); refuses a split that cannot
    cover the config's decoder layers, before anything is built."""
    if setup.degrees.pp == 1:
        return ()
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    return stage_layouts(config.num_hidden_layers, setup.degrees.pp, setup.pipeline.layer_split, tied)


def _load_arguments(request: LoadRequest) -> dict[Feature, str]:
    """What the load combines, for the combination table: the setup's features and the options'."""
    options = request.options
    asked = {
        Feature.FOUR_BIT: ("quantization_config", options.quantization_config is not None),
        Feature.FROM_CONFIG: ("from_config", request.checkpoint is None),
        Feature.BF16_MIXED: ("precision='bf16-mixed'", options.precision == Precision.BF16_MIXED),
        Feature.COMPILE: ("compile=True", options.compile),
    }
    return setup_arguments(request.setup) | {feature: name for feature, (name, used) in asked.items() if used}


def _loss(request: LoadRequest, quantization: QuantizationSettings | None, adapters: Adapters | None) -> LossPlan:
    """The chunked loss wherever the model and the layout allow it, else the full logits and why."""
    if request.options.loss == LossPath.FULL:
        return LossPlan(LossPath.FULL, "loss='full' asked")
    transform = head_transform(request.config)
    why_full = _why_full_logits(request, quantization, adapters)
    if why_full is None and transform is None:
        why_full = f"model_type={request.config.get_text_config().model_type!r} is not verified for the chunked loss"
    if why_full is not None:
        return LossPlan(LossPath.FULL, why_full)
    return LossPlan(LossPath.CHUNKED, "", DEFAULT_CHUNK_TOKENS, transform)


def _why_full_logits(
    request: LoadRequest, quantization: QuantizationSettings | None, adapters: Adapters | None
) -> str | None:
    """Why this load's steps need the whole logits (not built chunked yet), or None."""
    options = request.options
    if adapters is Adapters.FILE:
        return "an adapter directory's target modules are read after the plan; lm_head may be one"
    if options.peft_config is not None and adapts_output_layer(options.peft_config):
        return "LoRA adapts lm_head, whose output the chunked loss does not compute through"
    if (
        quantization is not None
        and quantization.skip_modules is not None
        and "lm_head" not in quantization.skip_modules
    ):
        return "lm_head is 4-bit (llm_int8_skip_modules does not keep it)"
    return None


def _adapters(options: LoadOptions) -> Adapters | None:
    if options.adapter is not None:
        return Adapters.FILE
    return None if options.peft_config is None else Adapters.NEW


def _ordered_steps(
    setup: DistributedSetup,
    has_checkpoint: bool,
    adapters: Adapters | None,
    quantized: bool,
    compiled: bool,
    pipelined: bool,
) -> tuple[Step, ...]:
    """The steps in the order they run (see :mod:`nemo_wrap.loading.plan` for why this order).
    Tensor parallel always shards the meta model (each rank reads only its slices), whatever the
    strategy that replicates or shards the result over dp needs on its own."""
    shard_first = setup.is_collective and (setup.entry.shards_on_meta or setup.uses_tensor_parallel)
    steps = [Step.BUILD_ON_META]
    if pipelined:  # before adapters and sharding: both then see only the stage's own modules
        steps.append(Step.KEEP_STAGE)
    if quantized:  # before adapters (they adapt the 4-bit layers) and sharding
        steps.append(Step.QUANTIZE_LAYERS)
    if adapters is not None:  # before sharding, so the adapters are sharded with their layers
        steps.append(Step.ADD_ADAPTERS)
    steps += [Step.SHARD, Step.MATERIALIZE] if shard_first else [Step.MATERIALIZE]
    if has_checkpoint:
        steps.append(Step.READ_CHECKPOINT)
    steps.append(Step.INITIALIZE_REST)
    if setup.is_collective and not shard_first:
        steps.append(Step.SHARD)
    if compiled:
        steps.append(Step.COMPILE_LAYERS)
    steps.append(Step.AUDIT)
    return tuple(steps)
