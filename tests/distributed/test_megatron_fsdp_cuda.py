"""Megatron-FSDP parity on a real GPU (skipped where CUDA or megatron-fsdp is absent).

megatron-fsdp calls CUDA directly, so this path cannot run on the CPU machines CI uses; it runs
where a GPU is lent (one process, nccl, world size 1: the manager's wiring and numerics).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-fsdp needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("megatron_fsdp") is None, reason="extra 'megatron' not installed"),
]


def test_megatron_fsdp_losses_match_plain_model_on_one_gpu():
    from megatron_fsdp import fully_shard_optimizer

    from nemo_wrap import DistributedSetup, destroy_distributed, initialize_distributed
    from nemo_wrap.auto import NeMoAutoModelForCausalLM
    from tests.support.tiny_models import tiny_config

    env = initialize_distributed()
    try:
        tokens = torch.randint(4, 257, (4, 16), generator=torch.Generator().manual_seed(0)).cuda()
        reference = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), seed=3).cuda()
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        expected = []
        for _ in range(3):
            loss = reference(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append(loss.item())

        setup = DistributedSetup.build("megatron_fsdp", env.world_size)
        wrapper = NeMoAutoModelForCausalLM.from_config(tiny_config("llama"), distributed_setup=setup, seed=3)
        assert type(wrapper.module).__name__.endswith("LlamaForCausalLM")
        optimizer = fully_shard_optimizer(torch.optim.AdamW(wrapper.parameters(), lr=1e-2))
        actual = []
        for _ in range(3):
            loss = wrapper(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            actual.append(loss.item())
        torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-5, atol=0)
    finally:
        destroy_distributed()
