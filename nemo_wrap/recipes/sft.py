"""Fine-tuning on text, chat, prompt/completion data, under any strategy: the one training loop.

The job reads top-down in :func:`run_sft`: data → model (with LoRA when asked) → teacher (when
distilling) → optimizer and batches → resume → steps (learning-rate schedule, evaluation,
rotating checkpoints, metrics) → save. A ``.txt`` file (or no data: the bundled corpus) is cut
into token windows; anything else is a data set of rows. Either way the rows go through the same
:class:`DataParallelBatches`, so resuming, evaluation and checkpoints work alike for both. Every
rank runs it; only the rank that speaks for the job prints, shows the progress bar and logs.

Faults end a run in a known state (``docs/how-to/faults.md``). A SIGTERM (a scheduler taking the machines
back) at any moment from reading the data to the end of the final save stops every rank at the same
point with every finished step kept (:mod:`.preemption`): before the first step with nothing to
save, during the loop after the unit under way with a resumable checkpoint, after the last step
with the final save finished and recorded (:mod:`.completion`). A rank that stops answering makes
the others raise :class:`PeerTimeoutError` after the process group's timeout, and one that dies
:class:`PeerLostError` at once, naming it; either names the phase. The checkpoints written so far
stay, and ``resume="auto"`` (after a restart by torchrun's ``--max-restarts``) continues from the
newest, data position included, once what killed saves left behind is resolved.

Why :class:`SFTConfig` holds the recipe's sections (:mod:`.config`) instead of fields of its own:
each training option is then declared once — name, default, help, flag and check — and reaches a
YAML file, the command line and this API alike; ``sft_config(recipe)`` hands the sections over
whole. A flat config mirroring them had drifted (other names, other defaults, a check made twice).
What a recipe cannot say stays here: the output directory, the load request as ``LoadOptions``,
the distillation settings as the training layer takes them, and the config trackers record.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint.leftovers import resolve_leftovers
from nemo_wrap.checkpoint.resume import load_checkpoint
from nemo_wrap.checkpoint.rotation import AUTO, CheckpointRotation, resolve_resume
from nemo_wrap.data import DataParallelBatches, as_rows, load_rows, prepare_examples, read_token_windows, window_rows
from nemo_wrap.default_model import bundled_corpus
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.env import peers_must_answer
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import InvalidSetupError, PreemptedError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.loading.provenance import LoadReport
from nemo_wrap.progress import progress_bar
from nemo_wrap.recipes.completion import COMPLETION_FILE, clear_completion, completed_steps, record_completion
from nemo_wrap.recipes.config import (
    CheckpointSection,
    DataSection,
    LoggingSection,
    OptimizerSection,
    TrainingSection,
)
from nemo_wrap.recipes.frozen_model import load_frozen_model
from nemo_wrap.recipes.metrics import MetricsLog
from nemo_wrap.recipes.preemption import StopRequest, stop_requests
from nemo_wrap.recipes.preference_job import (
    preference_evaluation,
    preference_reference,
    preference_rows,
    preference_step_function,
)
from nemo_wrap.recipes.schedule import learning_rate
from nemo_wrap.training import StepResult, evaluate, train_step
from nemo_wrap.training.distillation import (
    DistillationResult,
    DistillationSettings,
    distillation_step,
)
from nemo_wrap.training.preference import PreferenceResult
from nemo_wrap.training.preference_loss import PreferenceSettings

Batch = dict[str, torch.Tensor]
TEXT_STEPS = 50  # the text job's default length: the embedded default's loss falls visibly in 50 steps


@dataclass(frozen=True)
class SFTConfig:
    """One fine-tuning job: the recipe's training sections, each option defined (default and check
    included) once in :mod:`.config`, plus what only a library call says.

    ``data.train=None`` is the bundled corpus; a ``.txt`` file is cut into ``data.seq_len``-token
    windows, anything else is a data set. ``training.steps`` wins over ``training.epochs``;
    ``load.peft_config`` makes it LoRA SFT (only the adapters train, and the adapter is saved).
    Locations are taken as given (``sft_config`` resolves a recipe's ``bundled:`` names), and
    ``logging.log_dir=None`` writes no files (a recipe's run fills in ``OUTPUT_DIR/logs``)."""

    output_dir: str
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)  # resume="auto": newest in output_dir
    logging: LoggingSection = field(default_factory=LoggingSection)
    distillation: DistillationSettings | None = None
    preference: PreferenceSettings | None = None  # dpo or simpo on preference pairs instead of cross-entropy
    load: LoadOptions = field(default_factory=LoadOptions)  # peft_config (LoRA SFT), precision, compile, ...
    run_config: Mapping[str, Any] | None = None  # what the trackers record as the run's config

    def __post_init__(self) -> None:
        if self.preference is None:
            return
        objective = self.preference.objective.value
        if self.distillation is not None:
            raise InvalidSetupError(f"training.objective={objective} with a distillation teacher: choose one objective")
        if is_text_data(self.data.train):
            raise InvalidSetupError(
                f"training.objective={objective} needs a preference data set (prompt, chosen, rejected) as data.train, "
                f"not {self.data.train or 'the bundled text corpus'}"
            )
        sft_only = {"data.pack": self.data.pack, "data.last_turn_only": self.data.last_turn_only}
        sft_only["data.format"] = self.data.format != "auto"
        if any(sft_only.values()):
            named = ", ".join(name for name, value in sft_only.items() if value)
            raise InvalidSetupError(
                f"training.objective={objective}: {named} applies to SFT data only (pairs are never packed)"
            )


@dataclass
class _Job:
    """What the steps work on, built once by :func:`run_sft`."""

    model: Any
    optimizer: torch.optim.Optimizer
    batches: DataParallelBatches
    step: Callable[[Sequence[Batch]], StepResult]
    log: MetricsLog
    evaluation: Callable[[], dict[str, float]] | None  # eval_loss, and a preference run's own metrics
    checkpoints: CheckpointRotation


def run_sft(
    model_path: str | Path, setup: DistributedSetup, config: SFTConfig, tokenizer: Any, say: Callable[[str], None]
) -> list[dict[str, float]]:
    """Run the job; return the metrics it logged (the same on every rank).

    Raises :class:`PreemptedError` when a SIGTERM stopped it (a resumable checkpoint of every
    finished step is then in place; before the first step there is nothing to save), and
    :class:`PeerTimeoutError` (:class:`PeerLostError`) when another rank stopped answering (died)
    during the load, a step, an evaluation or a save. A SIGTERM after the last step lets the final
    save finish: the run is complete.
    """
    with stop_requests() as stop:  # from reading the data to the end of the final save
        return _run(model_path, setup, config, tokenizer, say, stop)


def _run(
    model_path: str | Path,
    setup: DistributedSetup,
    config: SFTConfig,
    tokenizer: Any,
    say: Callable[[str], None],
    stop: StopRequest,
) -> list[dict[str, float]]:
    data, training = config.data, config.training
    preference = config.preference is not None
    train_rows = _training_rows(data, tokenizer, say, preference)
    eval_rows = _data_set_rows(data.eval, data, tokenizer, say, preference) if data.eval else None
    batches = DataParallelBatches(
        train_rows, training.batch_size, training.seed, setup.dp_rank(), setup.dp_size, training.accumulation
    )
    total = _total_steps(config, batches)
    with peers_must_answer("preparing the run"):
        if _already_complete(config, total, say):
            return []
        _stop_before_training(stop, "reading the data", None, 0)
    with peers_must_answer("loading the model"):
        model = _load_model(model_path, setup, config, say)
        job = _job(model, model_path, setup, config, (batches, eval_rows), say)
        say(
            f"batches: {training.batch_size} rows per rank x {training.accumulation} micro-batch(es) x "
            f"{setup.dp_size} data-parallel rank(s) per step"
        )
        try:
            start, resume = _resume(job, config, say)
            _stop_before_training(stop, "loading the model", resume, start)
            clear_completion(config.output_dir)
        except BaseException:  # the trackers' runs end, as after the steps
            job.log.close()
            raise
    _train_and_evaluate(job, range(start, total), config, setup, stop)
    with peers_must_answer("the final save"):
        model.save_pretrained(config.output_dir, tokenizer=tokenizer)
        record_completion(config.output_dir, total)
        stopped_during_save = stop.agreed()
    say(f"saved to {config.output_dir}")
    if stopped_during_save:  # after the last step: the final save it let finish is the resumable state
        say("a SIGTERM arrived after the last step: the final save was finished, and the run is complete")
    return job.log.records


def _already_complete(config: SFTConfig, total: int, say: Callable[[str], None]) -> bool:
    """Resolve what killed saves left in the output directory; then whether ``--resume auto`` finds
    this run already finished there (its completion record names ``total`` steps)."""
    for leftover in resolve_leftovers(config.output_dir):  # before any checkpoint is looked for
        say(f"leftovers of a killed save: {leftover.describe()}")
    if config.checkpoint.resume != AUTO or completed_steps(config.output_dir) != total:
        return False
    say(f"{config.output_dir}: {COMPLETION_FILE} says this run's {total} steps are done: nothing to train")
    return True


def _resume(job: _Job, config: SFTConfig, say: Callable[[str], None]) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint it comes from (``0, None``: from the start)."""
    resume = resolve_resume(config.checkpoint.resume, config.output_dir)
    if resume is None:
        return 0, None
    start = load_checkpoint(resume, job.model, job.optimizer, data=job.batches)
    say(f"resumed from {resume} at step {start}")
    return start, resume


def _load_model(model_path: str | Path, setup: DistributedSetup, config: SFTConfig, say: Callable[[str], None]) -> Any:
    """The model through the audited pipeline (its load report said), recomputing when asked."""
    model = NeMoAutoModelForCausalLM.from_pretrained(model_path, distributed_setup=setup, options=config.load)
    say(cast(LoadReport, model.load_report).summary())
    if config.training.activation_checkpointing:
        model.activation_checkpointing_enable()
        say("activation checkpointing: each decoder layer recomputes its activations in the backward")
    return model


def _total_steps(config: SFTConfig, batches: DataParallelBatches) -> int:
    """The run's number of steps: ``training.steps``, else the text job's default, else its epochs'."""
    if config.training.steps:
        return config.training.steps
    return TEXT_STEPS if is_text_data(config.data.train) else config.training.epochs * batches.steps_per_epoch


def _stop_before_training(stop: StopRequest, phase: str, resume: Path | None, step: int) -> None:
    """Before the first step nothing is lost by stopping: if any rank was asked to, every rank
    raises :class:`PreemptedError` at once (collective: every rank calls it at the same point),
    naming ``step``, the step the resumed checkpoint holds (0 without one)."""
    if not stop.agreed():
        return
    kept = f"the checkpoint resumed from, {resume}, is still the newest" if resume else "nothing was trained"
    raise PreemptedError(
        f"stopped by SIGTERM before the first step (after {phase}): {kept} and nothing was saved; "
        f"run the same command with --resume auto to start again",
        step,
        str(resume or ""),
    )


def _train_and_evaluate(job: _Job, steps: range, config: SFTConfig, setup: DistributedSetup, stop: StopRequest) -> None:
    """The steps, then the closing evaluation; every background save in place when it returns. A
    preference run is also evaluated before its first step: the reward accuracy is 0 there (every
    reward is), but how often the model already prefers the chosen answer is where it starts."""
    try:
        if config.preference is not None and job.evaluation is not None and steps.start == 0:
            with peers_must_answer("the evaluation before the first step"):  # where the model starts
                job.log.log(0, **job.evaluation())
        stopped = _train(job, steps, config, setup, stop)
        if stopped is not None:
            raise _stop_with_checkpoint(job, stopped, steps.stop, config.checkpoint.save_every)
        if job.evaluation is not None and not _evaluated_at(job.log, steps.stop):
            with peers_must_answer("the closing evaluation"):
                job.log.log(steps.stop, **job.evaluation())
        with peers_must_answer("the last checkpoint's background save"):
            job.checkpoints.close()  # collective: a background save is in place before the model is saved
    finally:
        job.log.close()


def _job(
    model: Any,
    model_path: str | Path,
    setup: DistributedSetup,
    config: SFTConfig,
    data: tuple[DataParallelBatches, list[Batch] | None],
    say: Callable[[str], None],
) -> _Job:
    """The optimizer, metrics log, step, evaluation and checkpoints of the run; ``data``: the
    training batches and the held-out rows (if any)."""
    (batches, eval_rows), training, logging = data, config.training, config.logging
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.optimizer.lr)
    job = RankGroup.job()
    log = job.on_every_rank(  # a tracker that fails to start on the writer must not leave the others waiting
        "opening the metrics trackers",
        lambda: MetricsLog(
            logging.log_dir,
            job.is_writer,
            logging.report_to,
            config.run_config,
            logging.mlflow_tracking_uri,
            Path(config.output_dir).name,
        ),
    )
    held_out = None if eval_rows is None else _held_out_micro_batches(eval_rows, training.batch_size, setup)
    evaluation: Callable[[], dict[str, float]] | None = None
    step: Callable[[Sequence[Batch]], StepResult]
    if config.preference is not None:
        reference = preference_reference(model, config.preference, model_path, (setup, config.load), say)
        max_grad_norm = config.optimizer.max_grad_norm
        step = preference_step_function(model, optimizer, config.preference, reference, max_grad_norm)
        if held_out is not None:
            evaluation = preference_evaluation(model, held_out, config.preference, reference)
    else:
        step = _step_function(model, optimizer, setup, config)
        evaluation = None if held_out is None else _evaluation(model, held_out)
    return _Job(
        model=model,
        optimizer=optimizer,
        batches=batches,
        step=step,
        log=log,
        evaluation=evaluation,
        checkpoints=CheckpointRotation(config.output_dir, config.checkpoint.keep_last, config.checkpoint.async_save),
    )


def _step_function(
    model: Any, optimizer: torch.optim.Optimizer, setup: DistributedSetup, config: SFTConfig
) -> Callable[[Sequence[Batch]], StepResult]:
    """One optimizer step on a step's micro-batches: ``train_step``, or with a teacher ``distillation_step``
    (the teacher loaded through the same audited pipeline and sharded by the same setup, frozen)."""
    settings, max_grad_norm = config.distillation, config.optimizer.max_grad_norm
    if settings is None:
        return lambda micro_batches: train_step(model, optimizer, micro_batches, max_grad_norm=max_grad_norm)
    teacher = load_frozen_model(
        settings.teacher, setup, LoadOptions(precision=config.load.precision, loss=config.load.loss)
    )

    def step(micro_batches: Sequence[Batch]) -> StepResult:
        return distillation_step(
            model, teacher, optimizer, micro_batches, settings.kd_ratio, settings.temperature, max_grad_norm
        )

    return step


def is_text_data(data: str | None) -> bool:
    """Whether ``data.train`` names text cut into ``data.seq_len``-token windows (the bundled
    corpus, or a ``.txt`` file) rather than a data set of ``data.max_length``-token rows."""
    return data is None or data.endswith(".txt")


def _training_rows(data: DataSection, tokenizer: Any, say: Callable[[str], None], preference: bool) -> list[Batch]:
    if not is_text_data(data.train):
        return _data_set_rows(str(data.train), data, tokenizer, say, preference)
    source = Path(data.train) if data.train else bundled_corpus()
    windows = read_token_windows(source, tokenizer, data.seq_len)
    say(f"data: {source} (text): {windows.shape[0]} windows of {data.seq_len} tokens")
    return window_rows(windows)


def _data_set_rows(
    source: str, data: DataSection, tokenizer: Any, say: Callable[[str], None], preference: bool
) -> list[Batch]:
    """A data set's rows: preference pairs for a preference run, else SFT examples (packed if asked)."""
    if preference:  # data.columns maps its prompt, chosen and rejected columns
        return preference_rows(source, data, tokenizer, say)
    rows = load_rows(source, format=data.format, columns=data.columns)
    prepared = prepare_examples(rows, tokenizer, data.max_length, last_turn_only=data.last_turn_only)
    say(f"data: {source} ({rows.format}): {prepared.summary()}")
    return as_rows(prepared.examples, data.max_length, tokenizer.pad_token_id or 0, data.pack)


def _held_out_micro_batches(rows: list[Batch], batch_size: int, setup: DistributedSetup) -> list[Batch]:
    """This rank's share of the held-out rows, in micro-batches: one epoch, in a fixed order."""
    batches = DataParallelBatches(rows, batch_size, seed=0, dp_rank=setup.dp_rank(), dp_size=setup.dp_size)
    return [micro_batch for step in batches.rest_of_epoch() for micro_batch in step]


def _evaluation(model: Any, micro_batches: list[Batch]) -> Callable[[], dict[str, float]]:
    """The held-out loss over every rank's ``micro_batches``, token-weighted."""
    return lambda: {"eval_loss": evaluate(model, micro_batches)}


def _pipeline_micro_batches(micro_batches: list[Batch], stages: int) -> list[Batch]:
    """Under pipeline parallel a step of one micro-batch is cut by rows into one per stage, so every
    stage has work (1F1B needs as many micro-batches as stages)."""
    if stages == 1 or len(micro_batches) > 1:
        return micro_batches
    rows = int(micro_batches[0]["input_ids"].shape[0])
    if rows % stages:
        raise InvalidSetupError(f"batch size {rows} must be a multiple of pp_size {stages}: one micro-batch per stage")
    size = rows // stages
    return [{key: value[i * size : (i + 1) * size] for key, value in micro_batches[0].items()} for i in range(stages)]


def _train(job: _Job, steps: range, config: SFTConfig, setup: DistributedSetup, stop: StopRequest) -> int | None:
    """Run ``steps``; return the step after which every rank agreed to stop (a SIGTERM), else ``None``.

    Each collective phase is named, so a rank that stops answering is reported with the step."""
    total, iterator, adamw = steps.stop, iter(job.batches), config.optimizer
    with progress_bar(len(steps), "finetune", RankGroup.job().is_writer, unit="step") as bar:
        for step in steps:
            done = step + 1
            rate = learning_rate(step, adamw.lr, adamw.warmup_steps, total, adamw.lr_schedule)
            for group in job.optimizer.param_groups:
                group["lr"] = rate
            started = time.perf_counter()
            with peers_must_answer(f"training step {done}"):
                result = job.step(_pipeline_micro_batches(next(iterator), setup.degrees.pp))
            tokens_per_s = result.label_tokens / (time.perf_counter() - started)
            job.log.log(done, **_step_metrics(result, rate, tokens_per_s))
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{rate:.2e}", tok_s=f"{tokens_per_s:,.0f}")
            if job.evaluation is not None and config.training.eval_every and done % config.training.eval_every == 0:
                with peers_must_answer(f"the evaluation after step {done}"):
                    evaluation = job.evaluation()
                job.log.log(done, **evaluation)
                bar.set_postfix(loss=f"{result.loss:.4f}", eval=f"{evaluation['eval_loss']:.4f}")
            if _saves_at(done, config.checkpoint.save_every):
                with peers_must_answer(f"the checkpoint of step {done}"):
                    job.checkpoints.save(job.model, job.optimizer, done, data=job.batches)
            with peers_must_answer(f"the stop-request all-reduce after step {done}"):
                if stop.agreed():  # asked during the step, its evaluation or its save
                    return done
            bar.update(1)
    return None


def _evaluated_at(log: MetricsLog, step: int) -> bool:
    """Whether ``step``'s evaluation is already logged (its ``eval_every`` fell on it): the run's
    closing evaluation would log the same loss twice."""
    return any(record["step"] == step and "eval_loss" in record for record in log.records)


def _saves_at(step: int, save_every: int | None) -> bool:
    """Whether the run writes a periodic checkpoint after ``step``."""
    return save_every is not None and save_every > 0 and step % save_every == 0


def _stop_with_checkpoint(job: _Job, step: int, total: int, save_every: int | None) -> PreemptedError:
    """Write the checkpoint of a run stopped on request after ``step`` (on every rank, together;
    unless its periodic save just wrote it) and wait until it is in place, a background save
    included; return the error that reports it."""
    with peers_must_answer(f"the checkpoint of step {step}, written to stop"):
        if _saves_at(step, save_every):
            target = job.checkpoints.output_dir / f"checkpoint-{step}"
        else:
            target = job.checkpoints.save(job.model, job.optimizer, step, data=job.batches)
        job.checkpoints.close()
    return PreemptedError(
        f"stopped by SIGTERM after step {step} of {total}, every rank at the same step; resumable checkpoint "
        f"{target}: run the same command with --resume auto to continue",
        step,
        str(target),
    )


def _step_metrics(result: StepResult, rate: float, tokens_per_s: float) -> dict[str, float]:
    """What each step logs: loss, learning rate, grad norm, tokens/s, this rank's peak memory (and a
    distillation step's two parts)."""
    metrics = {"loss": result.loss, "lr": rate, "tokens_per_s": tokens_per_s}
    if result.grad_norm is not None:
        metrics["grad_norm"] = result.grad_norm
    if isinstance(result, DistillationResult):
        metrics.update(ce_loss=result.ce_loss, kd_loss=result.kd_loss)
    if isinstance(result, PreferenceResult):
        metrics.update(result.metrics())
    metrics["peak_memory_mib"] = _peak_memory_mib()
    return metrics


def _peak_memory_mib() -> float:
    """On CUDA the allocator's peak of tensor bytes (``torch.cuda.max_memory_allocated``); on the
    CPU, which has no tensor allocator to ask, the process's peak resident memory (RSS)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
