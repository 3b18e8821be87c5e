"""Tiny checkpoints written with transformers' own ``save_pretrained`` (HF keys, HF layout)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.support.tiny_models import tiny_config


def write_checkpoint(directory: Path, kind: str, values: str, tie: bool, max_shard_size: str | None = None,
                     dtype: torch.dtype = torch.float32, **config_overrides) -> Path:
    """Save a tiny ``kind`` model whose tensors are all 0.5 (``values="half"``), all distinct, or
    transformers' seeded init (``values="random"``).

    ``config_overrides`` change the tiny config (e.g. ``vocab_size`` to fit a tokenizer).
    Distinct: every element of every tensor differs from every other one (a wrong key, offset or
    layout cannot go unnoticed); values stay small so logits are well conditioned.
    """
    config = tiny_config(kind, tie_word_embeddings=tie, **config_overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    start = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if values == "random":
                break  # transformers' own init, seeded: a model whose outputs respond to training
            if values == "half":
                parameter.fill_(0.5)
            else:
                # a distinct value per element across the whole model: a shuffled ramp in
                # [-0.05, 0.05), steps of 1e-7 — far above float32 resolution there
                count = parameter.numel()
                ramp = torch.arange(start, start + count, dtype=torch.float64)
                shuffled = ramp[torch.randperm(count, generator=torch.Generator().manual_seed(start))]
                parameter.copy_((shuffled * 1e-7 - 0.05).view_as(parameter))
                start += count
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory
