"""Training-step throughput on 2 CPU ranks: nemo_wrap's strategies against plain PyTorch.

A ~100M-parameter Llama, fp32, batch 2 × 256 tokens per rank, AdamW. The baseline is transformers'
``LlamaForCausalLM`` under torch's own ``DistributedDataParallel`` with a plain
loss/backward/step loop; ours is ``from_config`` + ``train_step`` under ddp, fsdp2 and tensor
parallel (tp=2: both ranks see the same batch, so its tokens/s counts one batch per step).
Run: ``python benchmarks/bench_training_step.py`` (launches torchrun itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH, SEQUENCE, WARMUP, STEPS = 2, 256, 1, 4


def llama_100m_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                       tie_word_embeddings=True)


def _measure(kind: str, output: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    env = initialize_distributed()
    generator = torch.Generator().manual_seed(env.rank if kind != "tp" else 0)
    batches = [torch.randint(0, 32000, (BATCH, SEQUENCE), generator=generator) for _ in range(WARMUP + STEPS)]
    if kind == "plain-ddp":
        torch.manual_seed(0)
        model = DistributedDataParallel(LlamaForCausalLM(llama_100m_config()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(tokens):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        strategy, tp = {"ddp": ("ddp", 1), "fsdp2": ("fsdp2", 1), "tp": ("fsdp2", 2)}[kind]
        setup = DistributedSetup.build(strategy, env.world_size, tp_size=tp)
        model = NeMoAutoModelForCausalLM.from_config(llama_100m_config(), distributed_setup=setup, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(tokens):
            train_step(model, optimizer, [{"input_ids": tokens}])

    for tokens in batches[:WARMUP]:
        step(tokens)
    dist.barrier()
    started = time.perf_counter()
    for tokens in batches[WARMUP:]:
        step(tokens)
    dist.barrier()
    seconds = time.perf_counter() - started
    distinct_batches = 1 if kind == "tp" else env.world_size
    tokens_per_second = STEPS * BATCH * SEQUENCE * distinct_batches / seconds
    params = sum(p.numel() for p in _config_params())
    if env.rank == 0:
        (output / f"{kind}.json").write_text(json.dumps(dict(kind=kind, tokens_per_second=tokens_per_second, params=params)))


def _config_params():
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return list(LlamaForCausalLM(llama_100m_config()).parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--measure")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if args.measure:
        _measure(args.measure, args.output)
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("plain-ddp", "ddp", "fsdp2", "tp"):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            __file__, "--measure", kind, "--output", tmp], check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            rows[kind] = json.loads((Path(tmp) / f"{kind}.json").read_text())
    base = rows["plain-ddp"]["tokens_per_second"]
    print(f"Llama {rows['plain-ddp']['params'] / 1e6:.0f}M params, fp32, 2 ranks × 1 thread, batch {BATCH}×{SEQUENCE}/rank")
    print(f"{'run':<12}{'tokens/s':>10}{'vs plain DDP':>14}")
    for kind, row in rows.items():
        print(f"{kind:<12}{row['tokens_per_second']:>10.0f}{row['tokens_per_second'] / base:>14.2f}")


if __name__ == "__main__":
    main()
