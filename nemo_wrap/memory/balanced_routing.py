"""The dry run's router under expert parallel: every expert gets the same number of tokens.

transformers' expert-parallel dispatch (``AllToAllEP``) counts the (token, expert) pairs bound for
each rank and reads the counts back to the host to size its all-to-all. In the dry run those counts
would be computed from fake tensors, which have no values, so the step could not go on. The dry run
therefore hands every experts module a fixed assignment instead of its router's choice: the
``k`` slots of token ``t`` go to experts ``t·k … t·k + k − 1`` (modulo the expert count), real
integers, so each expert receives ``tokens · k / experts`` pairs and every rank of an expert group
the same number of rows. Every rank routes alike, so the fake process group's all-to-all (which
returns its input) delivers exactly the counts a real all-to-all would under that assignment.

The prediction is thus the step's memory under balanced routing — what auxiliary load-balancing
losses aim for. A real router deviates, and the rows an expert rank receives grow with it; the
deviation measured on the benchmark's MoE model is stated in the docs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nemo_wrap.distributed.expert_parallel import ExpertLayout
from nemo_wrap.distributed.expert_parallel.sharding import experts_modules


def balanced_assignment(tokens: int, slots: int, experts: int, like: torch.Tensor) -> torch.Tensor:
    """Expert ids of shape ``(tokens, slots)``: slot ``s`` of token ``t`` to expert ``(t·slots + s) % experts``."""
    return (torch.arange(tokens * slots, device=like.device) % experts).view(tokens, slots).to(dtype=like.dtype)


@contextmanager
def balanced_routing(model: nn.Module, layout: ExpertLayout) -> Iterator[None]:
    """Within it, each experts module of ``model`` gets :func:`balanced_assignment` as its expert ids."""

    def route_evenly(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden_states, top_k_index, *rest = args
        tokens, slots = top_k_index.shape
        return (hidden_states, balanced_assignment(tokens, slots, layout.num_experts, top_k_index), *rest)

    handles = [module.register_forward_pre_hook(route_evenly) for module in experts_modules(model, layout)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
