"""A fine-tuning recipe: every setting of a ``nemo-wrap finetune`` job, in sections, as one typed value.

The recipe is what a YAML file (``--config``), the command-line flags and ``--print-config`` all
describe, and what a run writes back as ``config.yaml``. Each field carries its own help, its
command-line flag (the flags of the CLI before recipes existed keep their names) and the check its
value must pass, so the file, the flags and the documentation cannot drift apart:
:mod:`nemo_wrap.recipes.config_file` reads all three from here.

Why plain dataclasses over jsonargparse or OmegaConf: the schema stays a frozen, typed value the
rest of the code passes around, errors can name the file line of the offending key (PyYAML's node
marks), and no dependency is added — PyYAML already comes with transformers.

The sections are also the library's job settings: :class:`nemo_wrap.recipes.sft.SFTConfig` holds
the training sections themselves, so a training option is one field here, with one default and one
check, whether it comes from a file, a flag or Python. Each section checks its fields when it is
built (:class:`Checked`), so ``OptimizerSection(lr_schedule="linear")`` in a script fails as clearly
as the same key in a file; the file reader runs the same checks earlier, to name the file line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nemo_wrap.distributed import PRECISIONS
from nemo_wrap.distributed.pipeline import SCHEDULES
from nemo_wrap.distributed.strategies import strategy_names
from nemo_wrap.distributed.strategies.fsdp2 import ReshardAfterForward
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.recipes.schedule import LearningRateSchedule
from nemo_wrap.recipes.trackers import REPORT_TO_NAMES
from nemo_wrap.training.preference_loss import PreferenceObjective

DEFAULT_OUTPUT_DIR = "nemo_wrap_output"


def _positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be positive"


def _not_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be 0 or more"


def _fraction(value: Any) -> str | None:
    return None if 0 <= value <= 1 else "must be between 0 and 1"


def _below_half(value: Any) -> str | None:
    return None if 0 <= value < 0.5 else "must be at least 0 and below 0.5"


def _one_of(*choices: Any):
    def check(value: Any) -> str | None:
        return None if value is None or value in choices else f"must be one of {', '.join(map(str, choices))}"

    return check


def _report_to(value: tuple[str, ...]) -> str | None:
    unknown = [name for name in value if name not in REPORT_TO_NAMES]
    return f"unknown tracker {unknown[0]!r}: choose {', '.join(REPORT_TO_NAMES)} or none" if unknown else None


def described(help: str, flag: str | None = None, check: Any = None) -> dict[str, Any]:
    """A recipe field's metadata: its help text, legacy flag (``--tp-size``) and value check."""
    return {"help": help, "flag": flag, "check": check}


def option(default: Any, help: str, flag: str | None = None, check: Any = None) -> Any:
    """A recipe field with an immutable default."""
    return field(default=default, metadata=described(help, flag, check))


def problem_with(check: Any, value: Any) -> str | None:
    """What is wrong with ``value`` by a field's ``check`` (``None``: nothing); ``None`` values pass,
    they mean "not set" or "off"."""
    return check(value) if check is not None and value is not None else None


class Checked:
    """A recipe section that runs its fields' checks when built, whoever builds it: the recipe
    reader (which has already checked each value, to name its file line) or a library user."""

    def __post_init__(self) -> None:
        for item in fields(self):  # type: ignore[arg-type]  # only dataclasses derive from Checked
            value = getattr(self, item.name)
            problem = problem_with(item.metadata.get("check"), value)
            if problem:
                raise InvalidSetupError(f"{type(self).__name__}.{item.name}: {problem}, got {value!r}")


@dataclass(frozen=True)
class DistributedSection(Checked):
    """How the job is laid out over ranks (``DistributedSetup.build``'s arguments) and how many."""

    strategy: str = option("fsdp2", f"{' | '.join(strategy_names())}", "--strategy", _one_of(*strategy_names()))
    nproc: int | None = option(
        None, "local ranks to launch through torchrun (under torchrun, its ranks instead)", "--nproc", _positive
    )
    tp_size: int = option(1, "tensor-parallel degree", "--tp-size", _positive)
    sequence_parallel: bool = option(
        False,
        "with tp: cut the activations between blocks along the sequence over the tp ranks (1/tp of them kept, "
        "the same bytes exchanged; not with pp)",
        "--sequence-parallel",
    )
    dp_replicate_size: int = option(1, "data-parallel replicas (HSDP with fsdp2)", "--dp-replicate-size", _positive)
    cp_size: int = option(1, "context-parallel degree (fsdp2)", "--cp-size", _positive)
    pp_size: int = option(1, "pipeline-parallel stages (fsdp2)", "--pp-size", _positive)
    ep_size: int = option(1, "expert-parallel degree of MoE layers (fsdp2)", "--ep-size", _positive)
    pp_schedule: str = option("1f1b", "pipeline schedule: 1f1b | gpipe", "--pp-schedule", _one_of(*SCHEDULES))
    reshard_after_forward: str | None = option(
        None,
        "fsdp2: which FSDP groups free their gathered parameters after the forward: layers (the default: "
        "the head stays gathered into the backward) | always | never",
        "--reshard-after-forward",
        _one_of(*ReshardAfterForward.words()),
    )
    max_restarts: int = option(
        0,
        "restarts of every rank after one fails (with --nproc; add --resume auto)",
        "--max-restarts",
        _not_negative,
    )
    timeout_s: float = option(
        1800.0, "seconds a collective waits for another rank before the job fails", "--timeout", _positive
    )


@dataclass(frozen=True)
class LoadSection(Checked):
    """How the checkpoint is loaded (``LoadOptions``)."""

    precision: str | None = option(
        None, "fp32 | bf16 | bf16-mixed; default: the checkpoint's dtype", "--precision", _one_of(*PRECISIONS)
    )
    quantization: str | None = option(
        None, "hold linear layers in 4 bits: nf4 | fp4 (the qlora extra)", "--quantization", _one_of("nf4", "fp4")
    )
    compile: bool = option(False, "torch.compile each decoder layer (not with tp)", "--compile")
    loss: str = option(
        "chunked",
        "the steps' loss: chunked (never the whole logits) | full (to compare)",
        "--loss",
        _one_of("chunked", "full"),
    )


@dataclass(frozen=True)
class LoraSection(Checked):
    """LoRA adapters (PEFT's ``LoraConfig``): only they train, and they are what is saved."""

    r: int | None = option(None, "LoRA rank; none: full fine-tuning", "--lora-r", _positive)
    alpha: int | None = option(None, "LoRA alpha (default 2 x rank)", "--lora-alpha", _positive)
    targets: str = option("all-linear", "comma-separated projections or all-linear", "--lora-targets")


@dataclass(frozen=True)
class DataSection(Checked):
    """What to train on: a UTF-8 ``.txt`` file (token windows) or a data set (JSONL/JSON/Parquet/CSV, hub id)."""

    train: str | None = option(None, "training data (default: the bundled corpus)", "--data")
    eval: str | None = option(None, "held-out data set: evaluation loss", "--eval-data")
    format: str = option(
        "auto", "data set format", "--format", _one_of("auto", "messages", "prompt_completion", "text")
    )
    columns: dict[str, str] = field(
        default_factory=dict, metadata=described("other column names: prompt=question,...", "--columns")
    )
    max_length: int = option(512, "tokens per data-set row", "--max-length", _positive)
    seq_len: int = option(64, "tokens per window of a .txt file", "--seq-len", _positive)
    pack: bool = option(False, "several examples per row, attention kept apart", "--pack")
    last_turn_only: bool = option(False, "learn only the last assistant turn", "--last-turn-only")


@dataclass(frozen=True)
class TrainingSection(Checked):
    """How long and on what batches."""

    steps: int | None = option(None, "optimizer steps (default: 50 on text, epochs on data sets)", "--steps", _positive)
    epochs: int = option(1, "passes over a data set unless steps", "--epochs", _positive)
    batch_size: int = option(8, "rows per rank per micro-batch", "--batch-size", _positive)
    accumulation: int = option(1, "micro-batches per step", "--accumulation", _positive)
    activation_checkpointing: bool = option(
        False,
        "recompute each decoder layer's activations in the backward: less memory, one more forward",
        "--activation-checkpointing",
    )
    objective: str = option(
        "sft",
        "sft (cross-entropy) | dpo | simpo (preference pairs: prompt, chosen, rejected)",
        "--objective",
        _one_of("sft", *(objective.value for objective in PreferenceObjective)),
    )
    seed: int = option(0, "data order seed", "--seed")
    eval_every: int | None = option(None, "evaluate every N steps (and at the end)", "--eval-every", _positive)


@dataclass(frozen=True)
class OptimizerSection(Checked):
    """AdamW and its learning-rate schedule."""

    lr: float = option(3e-3, "peak learning rate", "--lr", _positive)
    warmup_steps: int = option(0, "linear learning-rate warm-up", "--warmup-steps", _not_negative)
    lr_schedule: str = option(
        LearningRateSchedule.COSINE.value,
        "after warm-up: cosine | constant",
        "--lr-schedule",
        _one_of(*LearningRateSchedule.words()),
    )
    max_grad_norm: float | None = option(1.0, "gradient clipping; none: off", "--max-grad-norm", _positive)


@dataclass(frozen=True)
class CheckpointSection(Checked):
    """Resumable checkpoints (DCP) written during the run, in ``OUTPUT_DIR/checkpoint-STEP``."""

    save_every: int | None = option(None, "resumable checkpoint every N steps", "--save-every", _positive)
    keep_last: int | None = option(None, "keep only the newest K checkpoints", "--keep-last", _positive)
    resume: str | None = option(None, "a checkpoint directory, or auto: the newest complete one", "--resume")
    async_save: bool = option(False, "write checkpoints in the background while training goes on", "--async-save")


@dataclass(frozen=True)
class LoggingSection(Checked):
    """Where metrics go: ``metrics.jsonl`` always, plus the trackers named (transformers' ``report_to`` names)."""

    log_dir: str | None = option(None, "metrics and tracker files (default OUTPUT_DIR/logs)", "--log-dir")
    report_to: tuple[str, ...] = option(
        ("tensorboard",), "trackers: tensorboard,wandb,mlflow or none", "--report-to", _report_to
    )
    mlflow_tracking_uri: str | None = option(
        None, "MLflow store (default $MLFLOW_TRACKING_URI, else file:LOG_DIR/mlruns)", "--mlflow-tracking-uri"
    )


@dataclass(frozen=True)
class DistillationSection(Checked):
    """Knowledge distillation from a teacher loaded and sharded like the student."""

    teacher: str | None = option(None, "teacher checkpoint directory; none: no distillation", "--teacher")
    kd_ratio: float = option(0.5, "weight of the distillation loss against cross-entropy", "--kd-ratio", _fraction)
    temperature: float = option(1.0, "softmax temperature of both distributions", "--kd-temperature", _positive)


@dataclass(frozen=True)
class PreferenceSection(Checked):
    """The constants of a preference objective (``training.objective`` dpo or simpo), TRL's names and defaults."""

    beta: float = option(
        0.1, "how far the policy may move from the reference (dpo); reward scale (simpo)", "--beta", _positive
    )
    label_smoothing: float = option(
        0.0, "the share of pairs assumed mislabelled (conservative DPO; simpo too)", "--label-smoothing", _below_half
    )
    simpo_gamma: float = option(0.5, "simpo: the target reward margin", "--simpo-gamma")


@dataclass(frozen=True)
class Recipe:
    """One ``nemo-wrap`` job. ``model: null`` is the embedded default (built on first use)."""

    model: str | None = option(None, "checkpoint directory (default: the embedded default)")
    output_dir: str = option(DEFAULT_OUTPUT_DIR, "where the fine-tuned model, checkpoints and logs go", "--output-dir")
    distributed: DistributedSection = field(default_factory=DistributedSection)
    load: LoadSection = field(default_factory=LoadSection)
    lora: LoraSection = field(default_factory=LoraSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    distillation: DistillationSection = field(default_factory=DistillationSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
