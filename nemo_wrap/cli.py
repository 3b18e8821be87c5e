"""The ``nemo-wrap`` command line: fine-tune, plan and report, on a checkpoint or the embedded default.

``nemo-wrap`` with no arguments is ``nemo-wrap finetune`` on the embedded default (a small Llama
built on first use, see :mod:`nemo_wrap.default_model`), so the first command a user runs is a real
fine-tuning job that finishes in about a minute on two CPU cores. Several ranks: run it under
``torchrun --nproc-per-node N -m nemo_wrap.cli ...``, or pass ``--nproc N`` and it re-launches
itself through ``torch.distributed.run --standalone``. Errors of nemo_wrap exit with status 2 and
one line naming the problem, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from nemo_wrap.distributed import PRECISIONS, DistributedSetup, destroy_distributed, initialize_distributed
from nemo_wrap.distributed.strategies import strategy_names
from nemo_wrap.errors import InvalidSetupError, NeMoWrapError, TokenizerNotFoundError
from nemo_wrap.validation import require_positive_int

if TYPE_CHECKING:
    from nemo_wrap.loading.options import LoadOptions
    from nemo_wrap.loading.provenance import LoadReport

_COMMANDS = ("finetune", "plan", "report")
# The degrees besides tp, as DistributedSetup.build names them (flags spell them with dashes).
_OTHER_DEGREES = {
    "dp_replicate_size": "data-parallel replicas (HSDP with fsdp2)",
    "cp_size": "context-parallel degree (fsdp2: each rank keeps a part of every sequence)",
    "pp_size": "pipeline-parallel stages (fsdp2; torch.distributed.pipelining)",
    "ep_size": "expert-parallel degree: each MoE layer's experts split over this many ranks (fsdp2)",
}
DEFAULT_OUTPUT_DIR = "nemo_wrap_output"


def _positive_int(text: str) -> int:
    try:
        return require_positive_int(int(text), "the value", InvalidSetupError)
    except InvalidSetupError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; ``main`` inserts ``finetune`` when no command is given."""
    parser = argparse.ArgumentParser(prog="nemo-wrap", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    helps = {
        "finetune": "fine-tune a causal LM on a text file or a chat data set and save it (the default command)",
        "plan": "print the load plan for a checkpoint, reading no weights",
        "report": "load a checkpoint and print where every parameter's values came from",
    }
    for name in _COMMANDS:
        # no abbreviations: --nproc must be spelled out to be removed before re-launching
        sub = commands.add_parser(name, help=helps[name], description=helps[name], allow_abbrev=False)
        sub.add_argument(
            "model",
            nargs="?",
            default=None,
            help="checkpoint directory (default: the embedded default, built on first use)",
        )
        sub.add_argument("--strategy", default="fsdp2", help=f"{' | '.join(strategy_names())} (default fsdp2)")
        sub.add_argument("--tp-size", type=_positive_int, default=1, help="tensor-parallel degree (default 1)")
        for degree, what in _OTHER_DEGREES.items():
            sub.add_argument(f"--{degree.replace('_', '-')}", type=_positive_int, default=1, help=f"{what} (default 1)")
        sub.add_argument(
            "--pp-schedule", default="1f1b", help="pipeline schedule with --pp-size > 1: 1f1b | gpipe (default 1f1b)"
        )
        sub.add_argument(
            "--precision",
            choices=PRECISIONS,
            default=None,
            help="fp32 | bf16 | bf16-mixed (fp32 master weights, bf16 compute); default: the checkpoint's dtype",
        )
        sub.add_argument(
            "--quantization",
            choices=("nf4", "fp4"),
            default=None,
            help="hold the linear layers in 4 bits (bitsandbytes, double quant; the qlora extra)",
        )
        sub.add_argument(
            "--nproc",
            type=_positive_int,
            default=None,
            help="number of ranks: plan describes that world; finetune and report re-launch "
            "themselves on that many local ranks through torchrun (do not combine with torchrun)",
        )
    _add_finetune_arguments(commands.choices["finetune"])
    return parser


def _add_finetune_arguments(finetune: argparse.ArgumentParser) -> None:
    """Options of fine-tuning itself (the text job and the data-set job share them)."""
    finetune.add_argument(
        "--steps", type=_positive_int, default=None, help="optimizer steps (default: 50 on text, --epochs on data sets)"
    )
    finetune.add_argument("--lr", type=_positive_float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    finetune.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per rank per step (default 8)")
    finetune.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence (default 64)")
    finetune.add_argument("--max-grad-norm", type=_positive_float, default=1.0, help="gradient clipping (default 1.0)")
    finetune.add_argument("--data", default=None, help="UTF-8 text file to train on (default: the bundled corpus)")
    finetune.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        help=f"where the fine-tuned checkpoint goes (default ./{DEFAULT_OUTPUT_DIR})",
    )
    finetune.add_argument("--seed", type=int, default=0, help="data order seed (default 0)")
    finetune.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (not with tp)")
    finetune.add_argument(
        "--qlora", action="store_true", help="QLoRA: --quantization nf4 and LoRA adapters (--lora-r, default 16)"
    )
    _add_data_set_arguments(finetune)


def _column_mapping(text: str) -> tuple[tuple[str, str], ...]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if not all(len(pair) == 2 and all(pair) for pair in pairs):
        raise argparse.ArgumentTypeError(f"expected ours=theirs[,ours=theirs...], got {text!r}")
    return tuple((ours, theirs) for ours, theirs in pairs)


def _add_data_set_arguments(finetune: argparse.ArgumentParser) -> None:
    """Options of fine-tuning on a data set (JSONL/JSON/Parquet/CSV or a hub id) rather than text."""
    group = finetune.add_argument_group("data sets (--data that is not a .txt file)")
    group.add_argument("--format", default="auto", help="auto | messages | prompt_completion | text (default auto)")
    group.add_argument("--columns", type=_column_mapping, default=(), help="other column names: prompt=question,...")
    group.add_argument("--max-length", type=_positive_int, default=512, help="tokens per row (default 512)")
    group.add_argument("--pack", action="store_true", help="several examples per row, attention kept apart")
    group.add_argument("--last-turn-only", action="store_true", help="learn only the last assistant turn")
    group.add_argument("--eval-data", default=None, help="held-out data set: evaluation loss")
    group.add_argument("--eval-every", type=_positive_int, default=None, help="evaluate every N steps (and at the end)")
    group.add_argument(
        "--epochs", type=_positive_int, default=1, help="passes over the data unless --steps (default 1)"
    )
    group.add_argument("--accumulation", type=_positive_int, default=1, help="micro-batches per step (default 1)")
    group.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up (default 0)")
    group.add_argument("--lr-schedule", default="cosine", choices=("cosine", "constant"), help="after warm-up")
    group.add_argument("--log-dir", default=None, help="write metrics.jsonl and TensorBoard events here")
    group.add_argument("--save-every", type=_positive_int, default=None, help="resumable checkpoint every N steps")
    group.add_argument("--resume", default=None, help="resume from a checkpoint written by --save-every")
    group.add_argument("--lora-r", type=_positive_int, default=None, help="LoRA rank: train adapters only")
    group.add_argument("--lora-alpha", type=_positive_float, default=None, help="LoRA alpha (default 2 x rank)")
    group.add_argument("--lora-targets", default="all-linear", help="comma-separated projections or all-linear")


def _model_path(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    from nemo_wrap.default_model import default_model_path

    return default_model_path()


def _launched_world_size() -> int | None:
    """The world size torchrun exported, or ``None`` when this process was not launched by it."""
    value = os.environ.get("WORLD_SIZE")
    return None if value is None else int(value)


def _without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` minus ``--nproc N``: torchrun's own parser would read ``--nproc`` as an ambiguous
    abbreviation of its ``--nproc-per-node`` even after the module name, and refuse to start."""
    kept: list[str] = []
    skip_value = False
    for token in argv:
        if skip_value:
            skip_value = False
        elif token == "--nproc":
            skip_value = True
        elif not token.startswith("--nproc="):
            kept.append(token)
    return kept


def _relaunch(argv: Sequence[str], nproc: int) -> int:
    """Run this command again on ``nproc`` local ranks through torchrun and return its exit status.

    Only the launcher's status comes back: a rank that fails prints its own error, and torchrun
    then exits non-zero (with status 1, whatever the rank's was).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "nemo_wrap.cli",
        *_without_nproc(argv),
    ]
    return subprocess.run(command, check=False).returncode


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise TokenizerNotFoundError(
            f"{path}: no tokenizer that transformers can load ({type(error).__name__})"
        ) from error


def _run_plan(args: argparse.Namespace) -> int:
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    world_size = args.nproc or _launched_world_size() or 1
    setup = _setup(args, world_size)
    print(NeMoAutoModelForCausalLM.plan(_model_path(args), distributed_setup=setup, options=_load_options(args)))
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    path = _model_path(args)
    env = initialize_distributed()
    try:
        setup = _setup(args, env.world_size)
        model = NeMoAutoModelForCausalLM.from_pretrained(
            path, distributed_setup=setup, options=_load_options(args, verify=True)
        )
        if env.is_main_process:
            print(model.load_report)
    finally:
        destroy_distributed()
    return 0


def _is_data_set(data: str | None) -> bool:
    return data is not None and not data.endswith(".txt")


def _run_sft(args: argparse.Namespace) -> int:
    from nemo_wrap.recipes import SFTConfig, run_sft

    path = _model_path(args)
    env = initialize_distributed()
    try:
        setup = _setup(args, env.world_size)
        say = print if env.is_main_process else (lambda *_: None)
        tokenizer = _tokenizer(path)
        config = SFTConfig(
            data=args.data, output_dir=args.output_dir, format=args.format, columns=args.columns,
            max_length=args.max_length,
            pack=args.pack, last_turn_only=args.last_turn_only, eval_data=args.eval_data,
            eval_every=args.eval_every, steps=args.steps, epochs=args.epochs, micro_batch_size=args.batch_size,
            accumulation=args.accumulation, lr=args.lr, warmup_steps=args.warmup_steps,
            lr_schedule=args.lr_schedule, max_grad_norm=args.max_grad_norm, seed=args.seed, log_dir=args.log_dir,
            save_every=args.save_every, resume=args.resume,
            load=_load_options(args, peft_config=_lora(args), compile=args.compile),
        )  # fmt: skip
        records = run_sft(path, setup, config, tokenizer, say)
        losses = [r["loss"] for r in records if "loss" in r]
        say(f"loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f} ({len(losses)} steps)")
    finally:
        destroy_distributed()
    return 0


def _run_finetune(args: argparse.Namespace) -> int:
    if _is_data_set(args.data):
        return _run_sft(args)
    import torch
    from tqdm.auto import tqdm

    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.default_model import bundled_corpus
    from nemo_wrap.training import iterate_batches, read_token_windows, train_step

    path = _model_path(args)
    env = initialize_distributed()
    try:
        setup = _setup(args, env.world_size)
        say = print if env.is_main_process else (lambda *_: None)
        options = _load_options(args, peft_config=_lora(args), compile=args.compile)
        say(NeMoAutoModelForCausalLM.plan(path, setup, options=options))
        # Tokenizer and data first: every rank fails on them alike, before the load's collectives.
        tokenizer = _tokenizer(path)
        data = Path(args.data) if args.data else bundled_corpus()
        windows = read_token_windows(data, tokenizer, args.seq_len)
        model = NeMoAutoModelForCausalLM.from_pretrained(path, distributed_setup=setup, options=options)
        say(cast("LoadReport", model.load_report).summary())
        dp_rank = setup.dp_rank()
        batches = iterate_batches(windows, args.batch_size, args.seed, dp_rank, setup.dp_size)
        say(
            f"data: {data} — {windows.shape[0]} windows of {args.seq_len} tokens; "
            f"{args.batch_size} per rank x {setup.dp_size} data-parallel rank(s) per step"
        )

        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        losses = []
        steps = args.steps or 50
        with tqdm(range(steps), desc="finetune", unit="step", disable=not env.is_main_process) as bar:
            for _ in bar:
                started = time.perf_counter()
                result = train_step(
                    model, optimizer, _micro_batches(next(batches), setup), max_grad_norm=args.max_grad_norm
                )
                losses.append(result.loss)
                tokens_per_s = result.label_tokens / (time.perf_counter() - started)
                bar.set_postfix(loss=f"{result.loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        say(f"loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f} ({len(losses)} steps)")

        # collective: every rank calls it; the tokenizer is written inside the same atomic swap
        model.save_pretrained(args.output_dir, tokenizer=tokenizer)
        say(f"saved the fine-tuned model and its tokenizer to {args.output_dir}")
    finally:
        destroy_distributed()
    return 0


_RUNNERS = {"finetune": _run_finetune, "plan": _run_plan, "report": _run_report}


def _load_options(args: argparse.Namespace, **options: Any) -> LoadOptions:
    """The load request of the command line: ``--precision`` and ``--quantization`` (``--qlora``)
    plus what the command adds."""
    from nemo_wrap.loading.options import LoadOptions

    return LoadOptions(precision=args.precision, quantization_config=_quantization(args), **options)


def _quantization(args: argparse.Namespace) -> Any:
    """``--quantization`` (``--qlora``: nf4) as transformers' ``BitsAndBytesConfig``: double quant, and
    compute in bf16 with ``--precision bf16``, else in fp32 (transformers' default)."""
    quant_type = "nf4" if getattr(args, "qlora", False) and args.quantization is None else args.quantization
    if quant_type is None:
        return None
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32,
    )


def _lora(args: argparse.Namespace) -> Any:
    """``--lora-r`` (or ``--qlora``, rank 16 unless given) as PEFT's ``LoraConfig``; ``None`` without."""
    rank = args.lora_r or (16 if args.qlora else None)
    if rank is None:
        return None
    from peft import LoraConfig

    targets = args.lora_targets if args.lora_targets == "all-linear" else args.lora_targets.split(",")
    return LoraConfig(r=rank, lora_alpha=args.lora_alpha or 2 * rank, target_modules=targets)


def _setup(args: argparse.Namespace, world_size: int) -> DistributedSetup:
    """The setup the command-line degrees describe, on ``world_size`` ranks."""
    degrees = {name: getattr(args, name) for name in _OTHER_DEGREES}
    schedule = args.pp_schedule
    return DistributedSetup.build(args.strategy, world_size, tp_size=args.tp_size, pp_schedule=schedule, **degrees)


def _micro_batches(batch: dict[str, Any], setup: DistributedSetup) -> list[dict[str, Any]]:
    """The text job's step: one micro-batch, or under pipeline parallel one per stage (split by rows)."""
    stages = setup.degrees.pp
    rows = int(batch["input_ids"].shape[0])
    if stages == 1:
        return [batch]
    if rows % stages:
        raise InvalidSetupError(
            f"--batch-size {rows} must be a multiple of --pp-size {stages}: one micro-batch per stage"
        )
    size = rows // stages
    return [{key: value[i * size : (i + 1) * size] for key, value in batch.items()} for i in range(stages)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nemo-wrap`` and ``python -m nemo_wrap.cli``; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*_COMMANDS, "-h", "--help"):
        argv = ["finetune", *argv]  # the main job is the default command
    args = parser.parse_args(argv)
    try:
        launched = _launched_world_size()
        if args.command != "plan" and args.nproc is not None:
            if launched is None and args.nproc > 1:
                _setup(args, args.nproc)  # fail before launching
                _model_path(args)  # build the default once, before the ranks start
                return _relaunch(argv, args.nproc)
            if launched is not None and launched != args.nproc:
                raise InvalidSetupError(f"--nproc {args.nproc} differs from torchrun's world size {launched}")
        return _RUNNERS[args.command](args)
    except NeMoWrapError as error:
        parser.exit(2, f"nemo-wrap: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
