"""Supervised fine-tuning on chat, prompt/completion or text data, under any strategy.

The job reads top-down in :func:`run_sft`: data → model (with LoRA when asked) → optimizer and
batches → resume → steps (learning-rate schedule, evaluation, checkpoints, metrics) → save.
Every rank runs it; only rank 0 prints, shows the progress bar and writes metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_wrap.auto import NeMoAutoModelForCausalLM
from nemo_wrap.checkpoint.resume import load_checkpoint, save_checkpoint
from nemo_wrap.data import DataParallelBatches, as_rows, load_rows, prepare_examples
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import InvalidSetupError
from nemo_wrap.loading.options import LoadOptions
from nemo_wrap.progress import progress_bar
from nemo_wrap.recipes.metrics import MetricsLog
from nemo_wrap.recipes.schedule import learning_rate
from nemo_wrap.training import evaluate, train_step

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SFTConfig:
    """One fine-tuning job. ``steps`` wins over ``epochs``; ``load.peft_config`` makes it LoRA SFT
    (only the adapters train, and the adapter is what is saved)."""

    data: str
    output_dir: str
    format: str = "auto"
    columns: tuple[tuple[str, str], ...] = ()  # (our column, the data's column), e.g. ("prompt", "question")
    max_length: int = 512
    pack: bool = False
    last_turn_only: bool = False
    eval_data: str | None = None
    eval_every: int | None = None
    steps: int | None = None
    epochs: int = 1
    micro_batch_size: int = 4
    accumulation: int = 1
    lr: float = 2e-4
    warmup_steps: int = 0
    lr_schedule: str = "cosine"
    max_grad_norm: float | None = 1.0
    seed: int = 0
    log_dir: str | None = None
    save_every: int | None = None
    resume: str | None = None
    load: LoadOptions = field(default_factory=LoadOptions)  # peft_config (LoRA SFT), precision, compile, ...


def run_sft(
    model_path: str | Path, setup: DistributedSetup, config: SFTConfig, tokenizer: Any, say: Callable[[str], None]
) -> list[dict[str, float]]:
    """Run the job; return the metrics it logged (the same on every rank)."""
    if config.lr_schedule not in ("constant", "cosine"):
        raise InvalidSetupError(f"lr_schedule must be 'constant' or 'cosine', got {config.lr_schedule!r}")
    train_rows = _rows(config.data, config, tokenizer, say)
    eval_rows = _rows(config.eval_data, config, tokenizer, say) if config.eval_data else None
    model = NeMoAutoModelForCausalLM.from_pretrained(model_path, distributed_setup=setup, options=config.load)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    dp_rank = setup.dp_rank()
    batches = DataParallelBatches(
        train_rows, config.micro_batch_size, config.seed, dp_rank, setup.dp_size, config.accumulation
    )
    total = config.steps or config.epochs * batches.steps_per_epoch
    start = load_checkpoint(config.resume, model, optimizer, data=batches) if config.resume else 0
    log = MetricsLog(config.log_dir, is_writer=RankGroup.job().is_writer)
    evaluation = _evaluation(model, eval_rows, config, dp_rank, setup.dp_size)
    try:
        _train(model, optimizer, batches, range(start, total), config, log, evaluation)
        if evaluation is not None:
            log.log(total, eval_loss=evaluation())
    finally:
        log.close()
    model.save_pretrained(config.output_dir, tokenizer=tokenizer)
    say(f"saved to {config.output_dir}")
    return log.records


def _rows(source: str, config: SFTConfig, tokenizer: Any, say: Callable[[str], None]) -> list[Batch]:
    rows = load_rows(source, format=config.format, columns=dict(config.columns))
    prepared = prepare_examples(rows, tokenizer, config.max_length, last_turn_only=config.last_turn_only)
    say(f"data: {source} ({rows.format}): {prepared.summary()}")
    return as_rows(prepared.examples, config.max_length, tokenizer.pad_token_id or 0, config.pack)


def _evaluation(
    model: Any, rows: list[Batch] | None, config: SFTConfig, dp_rank: int, dp_size: int
) -> Callable[[], float] | None:
    """The held-out loss, token-weighted over every rank (``None`` without held-out data)."""
    if rows is None:
        return None
    batches = DataParallelBatches(rows, config.micro_batch_size, seed=0, dp_rank=dp_rank, dp_size=dp_size)
    micro_batches = [micro_batch for step in batches.rest_of_epoch() for micro_batch in step]
    return lambda: evaluate(model, micro_batches)


def _train(
    model: Any,
    optimizer: torch.optim.Optimizer,
    batches: DataParallelBatches,
    steps: range,
    config: SFTConfig,
    log: MetricsLog,
    evaluation: Callable[[], float] | None,
) -> None:
    total, iterator = steps.stop, iter(batches)
    with progress_bar(len(steps), "finetune", RankGroup.job().is_writer, unit="step") as bar:
        for step in steps:
            rate = learning_rate(step, config.lr, config.warmup_steps, total, config.lr_schedule)
            for group in optimizer.param_groups:
                group["lr"] = rate
            started = time.perf_counter()
            result = train_step(model, optimizer, next(iterator), max_grad_norm=config.max_grad_norm)
            tokens_per_s = result.label_tokens / (time.perf_counter() - started)
            log.log(step + 1, loss=result.loss, lr=rate, tokens_per_s=tokens_per_s)
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{rate:.2e}", tok_s=f"{tokens_per_s:,.0f}")
            if evaluation is not None and config.eval_every and (step + 1) % config.eval_every == 0:
                eval_loss = evaluation()
                log.log(step + 1, eval_loss=eval_loss)
                bar.set_postfix(loss=f"{result.loss:.4f}", eval=f"{eval_loss:.4f}")
            if config.save_every and (step + 1) % config.save_every == 0:
                checkpoint = Path(config.output_dir) / f"checkpoint-{step + 1}"
                save_checkpoint(checkpoint, model, optimizer, step + 1, data=batches)
            bar.update(1)
