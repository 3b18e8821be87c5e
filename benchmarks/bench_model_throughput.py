"""Training throughput of our fused Llama against transformers' ``LlamaForCausalLM``, one process.

Forward + backward (loss on the logits, no optimizer) of a ~110M-parameter Llama, in fp32 and
bf16, on the same weights. Timed steps alternate between the two models so that background load
on a shared machine hits both alike; the table reports the median step.

bf16 runs a smaller batch by default: on CPUs without native bf16 matmul (no AVX512-BF16/AMX) the
weight-gradient GEMMs take a slow path, ~25x slower than fp32 per token here, which would make a
4 x 256 bf16 step take minutes.

    python benchmarks/bench_model_throughput.py [--batch 4] [--seq 256] [--bf16-batch 1] [--bf16-seq 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nemo_wrap.models.llama import NeMoLlamaForCausalLM

CONFIG = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)


def _train_step(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """One forward + backward; returns its wall time in seconds."""
    started = time.perf_counter()
    loss = model(input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    elapsed = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return elapsed


def _models(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    hf = LlamaForCausalLM(config)
    ours = NeMoLlamaForCausalLM(config)
    ours.load_state_dict(ours.state_dict_adapter(config).from_hf(hf.state_dict()))
    return ours.to(dtype).train(), hf.to(dtype).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--bf16-batch", type=int, default=1)
    parser.add_argument("--bf16-seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for dtype, batch, seq in ((torch.float32, args.batch, args.seq), (torch.bfloat16, args.bf16_batch, args.bf16_seq)):
        input_ids = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=generator)
        tokens = batch * seq
        ours, hf = _models(dtype)
        parameters = sum(p.numel() for p in ours.parameters())
        for _ in range(args.warmup):
            _train_step(ours, input_ids)
            _train_step(hf, input_ids)
        ours_times, hf_times = [], []
        for _ in range(args.steps):
            ours_times.append(_train_step(ours, input_ids))
            hf_times.append(_train_step(hf, input_ids))
        ours_rate = tokens / statistics.median(ours_times)
        hf_rate = tokens / statistics.median(hf_times)
        rows.append((str(dtype).removeprefix("torch."), f"{batch}x{seq}", parameters, ours_rate, hf_rate))
        del ours, hf

    print(f"{'dtype':<9}{'batch':>7}{'params':>9}{'ours tok/s':>13}{'HF tok/s':>11}{'ours/HF':>9}")
    for dtype, shape, parameters, ours_rate, hf_rate in rows:
        ratio = ours_rate / hf_rate
        print(f"{dtype:<9}{shape:>7}{parameters / 1e6:>8.1f}M{ours_rate:>13.1f}{hf_rate:>11.1f}{ratio:>9.3f}")


if __name__ == "__main__":
    main()
