"""From a recipe to what the library runs: the checkpoint path, the setup, the load options, the job.

The recipe (:mod:`.config`) is what a user writes; :class:`nemo_wrap.recipes.sft.SFTConfig`,
:class:`DistributedSetup` and :class:`LoadOptions` are what the library takes. Every command of the
CLI goes through these functions, so a recipe means the same thing to ``finetune``, ``plan`` and
``report``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nemo_wrap.checkpoint.atomic import write_text_atomically
from nemo_wrap.distributed import DistributedSetup
from nemo_wrap.distributed.precision import Precision
from nemo_wrap.recipes.config import Recipe
from nemo_wrap.recipes.config_file import recipe_as_dict, recipe_to_yaml

if TYPE_CHECKING:
    from nemo_wrap.loading.options import LoadOptions
    from nemo_wrap.memory import TrainingShape
    from nemo_wrap.recipes.sft import SFTConfig
    from nemo_wrap.training.preference_loss import PreferenceSettings

RECIPE_FILE = "config.yaml"  # the resolved recipe every fine-tuning run writes into its output directory


def model_path(recipe: Recipe) -> Path:
    """The recipe's checkpoint: a directory, a ``bundled:`` name, or (none) the embedded default."""
    from nemo_wrap.default_model import default_model_path, resolve_bundled

    return Path(resolve_bundled(recipe.model)) if recipe.model is not None else default_model_path()


def _located(location: str | None) -> str | None:
    """A data set or teacher location with ``bundled:`` names resolved."""
    from nemo_wrap.default_model import resolve_bundled

    return None if location is None else resolve_bundled(location)


def write_recipe(recipe: Recipe, path: Path) -> None:
    """``config.yaml``, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, recipe_to_yaml(recipe))


def sft_config(recipe: Recipe) -> SFTConfig:
    """The library's job settings: the recipe's training sections as they are, with ``bundled:``
    names resolved and the log directory filled in (``OUTPUT_DIR/logs`` unless set)."""
    from nemo_wrap.recipes import SFTConfig
    from nemo_wrap.training.distillation import DistillationSettings

    data, logging, teacher = recipe.data, recipe.logging, recipe.distillation
    return SFTConfig(
        output_dir=recipe.output_dir,
        data=replace(data, train=_located(data.train), eval=_located(data.eval)),
        training=recipe.training,
        optimizer=recipe.optimizer,
        checkpoint=recipe.checkpoint,
        logging=replace(logging, log_dir=logging.log_dir or str(Path(recipe.output_dir) / "logs")),
        distillation=DistillationSettings(str(_located(teacher.teacher)), teacher.kd_ratio, teacher.temperature)
        if teacher.teacher
        else None,
        preference=_preference(recipe),
        load=load_options(recipe, peft_config=_lora(recipe), compile=recipe.load.compile),
        run_config=recipe_as_dict(recipe),
    )


def _preference(recipe: Recipe) -> PreferenceSettings | None:
    """The preference objective and its constants; ``None`` for cross-entropy (``sft``)."""
    if recipe.training.objective == "sft":
        return None
    from nemo_wrap.training.preference_loss import PreferenceObjective, PreferenceSettings

    constants = recipe.preference
    objective = PreferenceObjective(recipe.training.objective)
    return PreferenceSettings(objective, constants.beta, constants.label_smoothing, constants.simpo_gamma)


def load_options(recipe: Recipe, **options: Any) -> LoadOptions:
    """The load request of the recipe: precision, 4-bit quantization and the steps' loss path, plus
    what the command adds."""
    from nemo_wrap.loading.options import LoadOptions

    precision = None if recipe.load.precision is None else Precision.parse(recipe.load.precision, "load.precision")
    return LoadOptions(precision=precision, quantization_config=_quantization(recipe), loss=recipe.load.loss, **options)


def _quantization(recipe: Recipe) -> Any:
    """``load.quantization`` as transformers' ``BitsAndBytesConfig``: double quant, and compute in
    bf16 with precision bf16, else in fp32 (transformers' default)."""
    if recipe.load.quantization is None:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.load.quantization,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if recipe.load.precision == Precision.BF16 else torch.float32,
    )


def _lora(recipe: Recipe) -> Any:
    """The ``lora`` section as PEFT's ``LoraConfig``; ``None`` without a rank."""
    lora = recipe.lora
    if lora.r is None:
        return None
    from peft import LoraConfig

    targets = lora.targets if lora.targets == "all-linear" else lora.targets.split(",")
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha or 2 * lora.r, target_modules=targets)


def distributed_setup(recipe: Recipe, world_size: int) -> DistributedSetup:
    """The setup the recipe's degrees describe, on ``world_size`` ranks (an unset strategy option:
    the strategy's own default)."""
    d = recipe.distributed
    options: dict[str, Any] = (
        {} if d.reshard_after_forward is None else {"reshard_after_forward": d.reshard_after_forward}
    )
    return DistributedSetup.build(
        d.strategy,
        world_size,
        tp_size=d.tp_size,
        dp_replicate_size=d.dp_replicate_size,
        cp_size=d.cp_size,
        pp_size=d.pp_size,
        ep_size=d.ep_size,
        pp_schedule=d.pp_schedule,
        sequence_parallel=d.sequence_parallel,
        **options,
    )


def training_shape(recipe: Recipe) -> TrainingShape:
    """The step the recipe's job runs, for the memory prediction: rows per rank per micro-batch
    (a preference run's pairs are two rows each), tokens per row (a text's windows or a data set's
    rows) and micro-batches per step. A DPO run's frozen copy is not in the prediction."""
    from nemo_wrap.memory import TrainingShape
    from nemo_wrap.recipes.sft import is_text_data

    data, training = recipe.data, recipe.training
    tokens = data.seq_len if is_text_data(data.train) else data.max_length
    rows = training.batch_size * (1 if training.objective == "sft" else 2)  # a pair is two sequences
    return TrainingShape(rows, tokens, training.accumulation, training.activation_checkpointing)
