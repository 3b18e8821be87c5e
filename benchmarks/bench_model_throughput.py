"""Training throughput of our fused Llama against transformers' ``LlamaForCausalLM``, one process.

Forward + backward (loss on the logits, no optimizer) of a ~110M-parameter Llama, in fp32 and
bf16, on the same weights. Timed steps alternate between the two models so that background load
on a shared machine hits both alike; the table reports the median step.

bf16 runs a smaller batch by default: on CPUs without native bf16 matmul (no AVX512-BF16/AMX) the
weight-gradient GEMMs take a slow path, ~25x slower than fp32 per token here, which would make a
4 x 256 bf16 step take minutes.

Run: ``python -m benchmarks.bench_model_throughput``.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common import Table
from nemo_wrap.models.common.state_dict_adapter import FusedStateDictAdapter
from nemo_wrap.models.llama import NeMoLlamaForCausalLM

CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}


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
    ours.load_state_dict(FusedStateDictAdapter(config).from_hf(hf.state_dict()))
    return ours.to(dtype).train(), hf.to(dtype).train()


def table(batch: int = 4, seq: int = 256, bf16_batch: int = 1, bf16_seq: int = 64, steps: int = 3) -> Table:
    generator = torch.Generator().manual_seed(0)
    result = Table(
        "forward + backward, ~110M Llama, one process",
        ["batch", "ours tokens/s", "transformers tokens/s", "ours / transformers"],
        note=f"Same weights, timed steps alternating between the two models, median of {steps} after a warm-up.",
    )
    for dtype, rows, length in ((torch.float32, batch, seq), (torch.bfloat16, bf16_batch, bf16_seq)):
        input_ids = torch.randint(0, CONFIG["vocab_size"], (rows, length), generator=generator)
        ours, hf = _models(dtype)
        _train_step(ours, input_ids)
        _train_step(hf, input_ids)
        ours_times, hf_times = [], []
        for _ in range(steps):
            ours_times.append(_train_step(ours, input_ids))
            hf_times.append(_train_step(hf, input_ids))
        ours_rate = rows * length / statistics.median(ours_times)
        hf_rate = rows * length / statistics.median(hf_times)
        name = str(dtype).removeprefix("torch.")
        ratio = ours_rate / hf_rate
        result.rows.append([name, f"{rows} × {length}", f"{ours_rate:.0f}", f"{hf_rate:.0f}", f"{ratio:.2f}"])
        del ours, hf
    return result


if __name__ == "__main__":
    print(table().markdown())
