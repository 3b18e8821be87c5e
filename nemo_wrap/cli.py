"""The ``nemo-wrap`` command line: fine-tune, plan and report, on a checkpoint or the embedded default.

``nemo-wrap`` with no arguments is ``nemo-wrap finetune`` on the embedded default (a small Llama
built on first use, see :mod:`nemo_wrap.default_model`), so the first command a user runs is a real
fine-tuning job that finishes in about a minute on two CPU cores. Several ranks: run it under
``torchrun --nproc-per-node N -m nemo_wrap.cli ...``, or pass ``--nproc N`` and it re-launches
itself through ``torch.distributed.run --standalone``. Errors of nemo_wrap exit with status 2 and
one line naming the problem, not a traceback.

Faults: ``--timeout SECONDS`` bounds how long a collective waits for a rank that stopped answering
(the others then fail with status 2, naming the step); a SIGTERM makes every rank finish its step,
write a resumable checkpoint and exit with status 75 (``PREEMPTED_EXIT_STATUS``, EX_TEMPFAIL: "try
again"; before the first step nothing is saved, and after the last one the final save is finished
and the run exits 0: ``docs/how-to/faults.md``); ``--max-restarts N`` (with ``--nproc``) restarts every
rank after one dies. With ``--save-every N --resume auto`` a restarted or rerun job continues from the newest complete
checkpoint: ``nemo-wrap finetune --nproc 2 --max-restarts 2 --save-every 10 --resume auto``.

A job is a recipe (:mod:`nemo_wrap.recipes.config`): ``--config FILE.yaml``, then the flags given —
every recipe key by its dotted name (``--distributed.tp_size 2``) and the older flags by theirs
(``--tp-size 2``) — override the schema's defaults in that order. This module only turns argv into
a recipe and launches; :mod:`nemo_wrap.recipes.job` turns the recipe into what the library runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path

from nemo_wrap.checkpoint.manifest import WEIGHTS_MANIFEST, verify_weights
from nemo_wrap.distributed import destroy_distributed, initialize_distributed
from nemo_wrap.distributed.collectives import RankGroup
from nemo_wrap.distributed.setup import DistributedSetup
from nemo_wrap.errors import (
    CorruptCheckpointError,
    InvalidSetupError,
    NeMoWrapError,
    PreemptedError,
    TokenizerNotFoundError,
)
from nemo_wrap.memory.prediction import DEFAULT_MARGIN
from nemo_wrap.recipes.config import Recipe
from nemo_wrap.recipes.config_file import (
    Setting,
    build_recipe,
    read_recipe_file,
    recipe_fields,
    recipe_to_yaml,
)
from nemo_wrap.recipes.flags import RecipeHelpFormatter, add_job_group, add_recipe_flags
from nemo_wrap.recipes.job import (
    RECIPE_FILE,
    distributed_setup,
    load_options,
    model_path,
    sft_config,
    training_shape,
    write_recipe,
)
from nemo_wrap.recipes.preemption import PREEMPTED_EXIT_STATUS

_COMMANDS = ("finetune", "plan", "report")
# The recipe sections whose flags each command takes (any command reads a whole recipe file).
_COMMAND_SECTIONS = {
    "finetune": None,  # all of them
    "plan": None,  # all of them: it predicts the memory of the very job finetune would run
    "report": ("model", "distributed", "load"),
}
_HELPS = {
    "finetune": "fine-tune a causal LM on a text file or a data set and save it (the default command)",
    "plan": "print the load plan for a checkpoint, and with --memory each rank's predicted memory, reading no weights",
    "report": "load a checkpoint and print where every parameter's values came from",
}
_EXAMPLE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# One each, shown by --help; each is a README command (tests/cross_cutting/test_readme.py runs them).
_EXAMPLES = {
    "finetune": f"nemo-wrap finetune {_EXAMPLE_MODEL} --data chat.jsonl --lora-r 16 --output-dir smollm2-lora",
    "plan": f"nemo-wrap plan {_EXAMPLE_MODEL} --nproc 8",
    "report": f"nemo-wrap report {_EXAMPLE_MODEL}",
}
_DESCRIPTION = (
    "Fine-tune, plan and report on a Hugging Face causal LM: a checkpoint directory, a hub id, or (none "
    "given) the embedded default. Under torchrun every rank runs the job; --nproc N launches N local ranks."
)
_MODEL_HELP = "a checkpoint directory or a hub id (org/name); none: the embedded default"
_QLORA_RANK = 16


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; ``main`` inserts ``finetune`` when no command is given.

    Every recipe key is a flag (:mod:`nemo_wrap.recipes.flags`), grouped by section in ``--help``.
    Flags default to *unset*, so a flag overrides the ``--config`` file only when given.
    """
    parser = argparse.ArgumentParser(prog="nemo-wrap", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        # no abbreviations: --nproc must be spelled out to be removed before re-launching
        sub = commands.add_parser(
            name,
            help=_HELPS[name],
            description=_HELPS[name],
            epilog=f"example:\n  {_EXAMPLES[name]}",
            usage=f"nemo-wrap {name} [MODEL] [--config FILE] [flags]",
            formatter_class=RecipeHelpFormatter,
            allow_abbrev=False,
        )
        job = add_job_group(sub)
        job.add_argument("model", nargs="?", default=None, metavar="MODEL", help=_MODEL_HELP)
        job.add_argument("--config", default=None, metavar="FILE", help="a YAML recipe; flags given override it")
        job.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
        if name == "finetune":
            job.add_argument(
                "--qlora", action="store_true", help=f"--quantization nf4 and --lora-r {_QLORA_RANK} unless set"
            )
        if name == "plan":
            _add_memory_flags(sub.add_argument_group("memory", "what each rank will hold, and a layout that fits"))
        add_recipe_flags(sub, job, _COMMAND_SECTIONS[name])
    return parser


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser in ``parser`` (:func:`build_parser`'s), by name: what its help and
    the generated CLI reference are made from."""
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return dict(commands.choices)


def _version() -> str:
    """This package's version and the two it is tested against, as a bug report needs them."""
    import torch
    import transformers

    from nemo_wrap import __version__

    return f"nemo-wrap {__version__} (torch {torch.__version__}, transformers {transformers.__version__})"


def _add_memory_flags(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--memory",
        action="store_true",
        help="predict each rank's tensor peak in one training step of this recipe (a dry run on fake "
        "tensors, some seconds); counted: parameters, gradients, optimizer state, activations, the "
        "loss, gathered and exchanged tensors; not counted: the allocator's caching and fragmentation, "
        "the CUDA context and library workspaces, the communication libraries' own buffers",
    )
    parser.add_argument("--device-memory", default=None, metavar="SIZE", help="per device, e.g. 80GiB: fits or not")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="choose the layout (degrees, micro-batch, activation checkpointing) of --nproc ranks per node on "
        "--nnodes nodes that is predicted to fit --device-memory less --margin and costs least, for the "
        "recipe's rows per step; print the best five, why the others were dropped, and the chosen one "
        "as a recipe fragment",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of --nproc ranks each (default 1)")
    parser.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help=f"share of --device-memory --auto keeps free for what is not counted (default {DEFAULT_MARGIN})",
    )
    parser.add_argument("--json", action="store_true", help='print {"plan": ..., "memory": ...} as JSON')


def _recipe(args: argparse.Namespace) -> Recipe:
    """The recipe of this command line: defaults, then ``--config``'s file, then the flags given."""
    settings = read_recipe_file(args.config) if args.config else []
    given = {key: value for key, value in vars(args).items() if key in recipe_fields() and key != "model"}
    flags = [Setting(key, value, _flag_of(key)) for key, value in given.items()]
    if args.model is not None:
        flags.append(Setting("model", args.model, "the model argument"))
    if getattr(args, "qlora", False):
        chosen = {setting.key for setting in [*settings, *flags]}
        shorthand = {"load.quantization": "nf4", "lora.r": _QLORA_RANK}
        flags += [Setting(key, value, "--qlora") for key, value in shorthand.items() if key not in chosen]
    return build_recipe([*settings, *flags])


def _flag_of(key: str) -> str:
    spec = recipe_fields()[key]
    return spec.flag or f"--{key}"


def _launched_world_size() -> int | None:
    """The world size torchrun exported, or ``None`` when this process was not launched by it."""
    value = os.environ.get("WORLD_SIZE")
    return None if value is None else int(value)


def _say_the_launcher_wins(nproc: int, launched: int) -> None:
    """Under torchrun the launcher's world runs the job: a recipe written for another size (its
    ``nproc``) is not an error, since the same recipe serves a laptop and a cluster. Rank 0 says so once."""
    if os.environ.get("RANK", "0") == "0":
        print(f"nemo-wrap: the recipe's nproc {nproc} is set aside: torchrun started {launched} rank(s)")


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


def _relaunch(argv: Sequence[str], recipe: Recipe) -> int:
    """Run this command again on ``distributed.nproc`` local ranks through torchrun; return its exit status.

    Only the launcher's status comes back: a rank that fails prints its own error, and torchrun
    then exits non-zero (with status 1, whatever the rank's was), after restarting every rank up to
    ``distributed.max_restarts`` times. A SIGTERM to this process (a scheduler stopping the job) is
    passed to torchrun's agent, which passes it to every rank: they write a checkpoint and stop.
    Torchrun then exits 1 with its own traceback, so this process says what was kept and returns
    :data:`PREEMPTED_EXIT_STATUS`.
    """
    launcher_options = ["--standalone", "--nproc-per-node", str(recipe.distributed.nproc)]
    launcher_options += ["--max-restarts", str(recipe.distributed.max_restarts)]
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_options, "-m", "nemo_wrap.cli"]
    with subprocess.Popen([*command, *_without_nproc(argv)]) as launcher, _forwarding_sigterm(launcher) as signals:
        status = launcher.wait()
    if not signals or status == 0:
        return status
    print(_stopped_message(recipe, status), file=sys.stderr)
    return PREEMPTED_EXIT_STATUS


@contextmanager
def _forwarding_sigterm(launcher: subprocess.Popen) -> Iterator[list[int]]:
    """Inside the block, each SIGTERM this process receives is sent on to ``launcher`` and counted
    in the list yielded; the previous handler is restored after."""
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        launcher.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _stopped_message(recipe: Recipe, status: int) -> str:
    """What a job stopped by SIGTERM kept: the newest complete checkpoint, and how to continue."""
    from nemo_wrap.checkpoint.rotation import newest_checkpoint

    newest = newest_checkpoint(recipe.output_dir)
    kept = "no resumable checkpoint was written" if newest is None else f"the newest complete checkpoint is {newest}"
    return (
        f"nemo-wrap: stopped by SIGTERM (passed on to every rank; torchrun exited with status {status}): {kept}; "
        f"run the same command with --resume auto to continue"
    )


def _final_summary(records: list[dict[str, float]]) -> str:
    """The run's last line: first and last training loss, and the last evaluation's loss and step."""
    losses = [record["loss"] for record in records if "loss" in record]
    evaluations = [record for record in records if "eval_loss" in record]
    parts = [f"loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f} ({len(losses)} steps)"] if losses else []
    if evaluations:
        parts.append(f"eval loss {evaluations[-1]['eval_loss']:.4f} after step {evaluations[-1]['step']:g}")
    return "; ".join(parts) or "no training step was left to run"


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise TokenizerNotFoundError(
            f"{path}: no tokenizer that transformers can load ({type(error).__name__})"
        ) from error


def _run_plan(recipe: Recipe, args: argparse.Namespace) -> int:
    """The load plan; with ``--memory`` (implied by ``--device-memory``) the predicted memory of
    one step of the recipe's job; with ``--json`` both as data."""
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.memory import parse_bytes, predict_memory

    world_size = (recipe.distributed.nproc or _launched_world_size() or 1) * args.nnodes
    setup, path, options = distributed_setup(recipe, world_size), model_path(recipe), load_options(recipe)
    plan = NeMoAutoModelForCausalLM.plan(path, distributed_setup=setup, options=options)
    device_memory = None if args.device_memory is None else parse_bytes(args.device_memory, "--device-memory")
    if args.auto:
        return _run_auto(recipe, args, setup, str(plan), device_memory)
    memory = None
    if args.memory or device_memory is not None:  # the job finetune runs: its LoRA too
        memory = predict_memory(path, setup, training_shape(recipe), sft_config(recipe).load, device_memory)
    if args.json:
        print(json.dumps({"plan": str(plan), "memory": None if memory is None else memory.as_data()}, indent=2))
    else:
        print(plan if memory is None else f"{plan}\n{memory}")
    return 0


def _run_auto(
    recipe: Recipe, args: argparse.Namespace, setup: DistributedSetup, plan: str, device_memory: int | None
) -> int:
    """``plan --auto``: the layout for the recipe's job (its rows per step, tokens per row and load
    options, LoRA included) on ``--nnodes`` nodes of ``--nproc`` ranks."""
    from nemo_wrap.memory import Machine, choose_layout

    if device_memory is None:
        raise InvalidSetupError("plan --auto needs --device-memory: the memory each device has")
    per_node = setup.world_size // args.nnodes
    machine = Machine(nproc_per_node=per_node, device_memory=device_memory, nnodes=args.nnodes)
    shape = training_shape(recipe)
    global_batch = shape.batch_size * shape.accumulation * setup.dp_size
    choice = choose_layout(
        model_path(recipe), machine, global_batch, shape.seq_len, sft_config(recipe).load, args.margin
    )
    print(json.dumps({"plan": plan, "auto": choice.as_data()}, indent=2) if args.json else choice)
    return 0


def _run_report(recipe: Recipe) -> int:
    from nemo_wrap.auto import NeMoAutoModelForCausalLM

    path = model_path(recipe)
    env = initialize_distributed(timeout_s=recipe.distributed.timeout_s)
    try:
        setup = distributed_setup(recipe, env.world_size)
        checked = _verified_weights(Path(path))
        model = NeMoAutoModelForCausalLM.from_pretrained(
            path, distributed_setup=setup, options=load_options(recipe, verify=True)
        )
        if env.is_main_process:
            if checked:
                print(f"weights: {checked} file(s) hold the contents the save wrote (digests in {WEIGHTS_MANIFEST})")
            print(model.load_report)
    finally:
        destroy_distributed()
    return 0


def _verified_weights(path: Path) -> int:
    """Rank 0 checks a consolidated save's weight files against their digests; every rank gets the
    count checked, or raises the same :class:`CorruptCheckpointError`."""
    return RankGroup.job().on_rank_zero(
        "checking the weights' digests",
        partial(verify_weights, path),
        lambda description: CorruptCheckpointError(f"{path}: {description}"),
        passed=(CorruptCheckpointError,),
    )


def _run_finetune(recipe: Recipe) -> int:
    """The fine-tuning job (:func:`nemo_wrap.recipes.run_sft`) the recipe describes; its resolved
    recipe is written to ``OUTPUT_DIR/config.yaml`` first, so ``--config`` of that file reruns it."""
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.recipes import run_sft

    path = model_path(recipe)
    env = initialize_distributed(timeout_s=recipe.distributed.timeout_s)
    try:
        setup = distributed_setup(recipe, env.world_size)
        say = print if env.is_main_process else (lambda *_: None)
        config = sft_config(recipe)
        say(NeMoAutoModelForCausalLM.plan(path, setup, options=config.load))
        tokenizer = _tokenizer(path)  # before anything is written: every rank fails on it alike
        if env.is_main_process:
            write_recipe(recipe, Path(recipe.output_dir) / RECIPE_FILE)
        records = run_sft(path, setup, config, tokenizer, say)
        say(_final_summary(records))
    finally:
        destroy_distributed()
    return 0


_RUNNERS = {"finetune": _run_finetune, "report": _run_report}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``nemo-wrap`` and ``python -m nemo_wrap.cli``; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*_COMMANDS, "-h", "--help", "--version"):
        argv = ["finetune", *argv]  # the main job is the default command
    args = parser.parse_args(argv)
    try:
        recipe = _recipe(args)
        if args.print_config:
            print(recipe_to_yaml(recipe), end="")
            return 0
        launched, nproc = _launched_world_size(), recipe.distributed.nproc
        if args.command != "plan" and nproc is not None:
            if launched is None and nproc > 1:
                distributed_setup(recipe, nproc)  # fail before launching
                model_path(recipe)  # build the default once, before the ranks start
                return _relaunch(argv, recipe)
            if launched is not None and launched != nproc:
                _say_the_launcher_wins(nproc, launched)
        if args.command == "plan":
            return _run_plan(recipe, args)
        return _RUNNERS[args.command](recipe)
    except PreemptedError as stop:  # not a failure: the job can go on from its checkpoint
        parser.exit(PREEMPTED_EXIT_STATUS, f"nemo-wrap: {stop}\n")
    except NeMoWrapError as error:
        parser.exit(2, f"nemo-wrap: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
