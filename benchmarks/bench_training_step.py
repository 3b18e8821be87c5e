"""Training-step throughput on 2 CPU ranks: nemo_wrap's strategies against plain PyTorch.

A ~100M-parameter Llama, fp32, batch 2 × 256 tokens per rank, AdamW, 2 ranks × 1 thread. The
baselines are transformers' ``LlamaForCausalLM`` under torch's ``DistributedDataParallel`` and
under torch's ``fully_shard`` (per decoder layer, then the root), with a plain loss/backward/step
loop; ours is ``from_config`` + ``train_step`` under ddp, fsdp2 and tensor parallel (tp=2: both
ranks see the same batch, so its tokens/s counts one batch per step). Target: ours ≥ 0.97× the
matching plain baseline. Run: ``python -m benchmarks.bench_training_step``.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Table, best_of, matmul_rate, measure_main

BATCH, SEQUENCE, WARMUP, STEPS = 2, 256, 1, 4
MODULE = "benchmarks.bench_training_step"
BASELINE = {"plain-ddp": "plain-ddp", "ddp": "plain-ddp", "plain-fsdp2": "plain-fsdp2", "fsdp2": "plain-fsdp2",
            "tp": "plain-fsdp2"}  # fmt: skip
LABELS = {
    "plain-ddp": "transformers + torch `DistributedDataParallel`",
    "ddp": "ours, ddp",
    "plain-fsdp2": "transformers + torch `fully_shard`",
    "fsdp2": "ours, fsdp2",
    "tp": "ours, tensor parallel tp=2",
}


def llama_100m_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                       tie_word_embeddings=True)  # fmt: skip


def _plain_model(kind: str):
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_100m_config())
    if kind == "plain-ddp":
        return DistributedDataParallel(model)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def measure(kind: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from nemo_wrap import DistributedSetup, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from nemo_wrap.training import train_step

    env = initialize_distributed()
    generator = torch.Generator().manual_seed(env.rank if kind != "tp" else 0)
    batches = [torch.randint(0, 32000, (BATCH, SEQUENCE), generator=generator) for _ in range(WARMUP + STEPS)]
    if kind.startswith("plain"):
        model = _plain_model(kind)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(tokens):
            model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
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
    peak = matmul_rate()
    dist.barrier()
    started = time.perf_counter()
    for tokens in batches[WARMUP:]:
        step(tokens)
    dist.barrier()
    seconds = time.perf_counter() - started
    distinct_batches = 1 if kind == "tp" else env.world_size
    tokens_per_second = STEPS * BATCH * SEQUENCE * distinct_batches / seconds
    parameters = sum(p.numel() for p in model.parameters())  # DTensors count their global size
    flops = 6 * parameters * tokens_per_second / env.world_size  # this rank's share
    return {"seconds": seconds, "tokens_per_second": tokens_per_second, "mfu": flops / peak}


def table(repeats: int = 3) -> Table:
    best = best_of(repeats, MODULE, list(LABELS), nproc=dict.fromkeys(LABELS, 2))
    rate = {kind: rows[0]["tokens_per_second"] for kind, rows in best.items()}
    result = Table(
        "training step, 100M Llama fp32, 2 ranks × 1 thread, 2 × 256 tokens per rank, AdamW",
        ["tokens/s", "vs plain baseline", "MFU"],
        note=f"Best of {repeats} runs of {STEPS} steps after {WARMUP} warm-up; tp=2 counts one batch per step. "
        "MFU: 6 · parameters · tokens/s ÷ the fp32 `torch.mm` rate of the 2 ranks measured side by side in the "
        "same job (`common.matmul_rate`).",
    )
    for kind, label in LABELS.items():
        mfu = sum(row["mfu"] for row in best[kind]) / len(best[kind])
        result.rows.append([label, f"{rate[kind]:.0f}", f"{rate[kind] / rate[BASELINE[kind]]:.2f}", f"{mfu:.0%}"])
    return result


if __name__ == "__main__":
    measure_main(measure, table)
