"""The ``nemo-wrap`` command line.

``nemo-wrap`` (or ``nemo-wrap demo``) is the main job on the embedded default: until the
fine-tuning job lands it builds a tiny Llama from a config, describes the distributed setup, lists
where every parameter's values come from, and checks that the fresh model's loss sits near
ln(vocab) — the signature of a properly initialized model, not of leftover memory.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from nemo_wrap.distributed import DistributedSetup, destroy_distributed, initialize_distributed
from nemo_wrap.errors import NeMoWrapError


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        tie_word_embeddings=True,
    )


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from nemo_wrap.auto_model import NeMoAutoModelForCausalLM

    env = initialize_distributed()
    setup = DistributedSetup.build(args.strategy, env.world_size, tp_size=args.tp_size)
    config = _tiny_llama_config()
    model = NeMoAutoModelForCausalLM.from_config(config, distributed_setup=setup, seed=args.seed)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(args.seed))
    with torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss.item()
    if env.is_main_process:
        count = sum(p.numel() for p in model.parameters())
        print(f"nemo-wrap demo: tiny {type(model).__name__}, {count:,} parameters on this rank, seed {args.seed}")
        print(setup.describe())
        print(model.load_report)
        print(f"loss of the fresh model {loss:.4f} (ln(vocab) = {math.log(config.vocab_size):.4f})")
    destroy_distributed()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-wrap", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    demo = commands.add_parser("demo", help="build a tiny Llama and describe it (the default)")
    demo.add_argument("--strategy", default="fsdp2", help="ddp | fsdp2 | megatron_fsdp (default fsdp2)")
    demo.add_argument("--tp-size", type=int, default=1)
    demo.add_argument("--seed", type=int, default=0)
    return parser


_COMMANDS = ("demo",)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*_COMMANDS, "-h", "--help"):
        argv = ["demo", *argv]  # the main job is the default command
    args = parser.parse_args(argv)
    try:
        return _run_demo(args)
    except NeMoWrapError as error:
        parser.exit(2, f"nemo-wrap: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
