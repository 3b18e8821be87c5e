"""The MoE load-balancing loss of the whole data-parallel batch, as one process computes it.

transformers adds ``router_aux_loss_coef × load_balancing_loss_func(router_logits, …)`` to the loss
of MoE families whose config sets ``output_router_logits`` (Switch Transformer's loss:
``n · Σ_i f_i · P_i``, with ``f_i`` the share of top-k assignments that went to expert ``i`` and
``P_i`` its mean router probability, over every layer's tokens). Computed on a rank's own batch,
that is not the loss of the global batch: both means run over all of its tokens. Here the
assignment counts and the token count are summed over the data-parallel ranks first (no gradient
flows through them in transformers either), and each rank keeps the term of its own
probabilities — ``n · Σ_i f_i · S_i / N`` with ``S_i`` its probability sum — so the ranks' terms
add up to the global loss and each rank's gradient is its share of the global one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nemo_wrap.distributed.expert_parallel import expert_count


def adds_router_loss(model: Any) -> bool:
    """Whether transformers' forward would add a load-balancing loss to this model's loss."""
    return bool(getattr(model.config, "output_router_logits", False)) and hasattr(model, "router_aux_loss_coef")


def router_loss_share(
    model: Any,
    router_logits: tuple[torch.Tensor, ...],
    attention_mask: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """This rank's term of ``router_aux_loss_coef ×`` the load-balancing loss of the batch of ``group``."""
    num_experts, top_k = expert_count(model.config), model.config.num_experts_per_tok
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for layer_logits in router_logits:
        probabilities = torch.softmax(layer_logits, dim=-1)
        _, selected = torch.topk(probabilities, top_k, dim=-1)
        weight = (
            torch.ones(layer_logits.shape[0], device=device)
            if attention_mask is None
            else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        )
        counts = counts.scatter_add(0, selected.reshape(-1), weight.repeat_interleave(top_k))
        probability_sums = probability_sums + (probabilities.float() * weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + weight.sum()
    totals = torch.cat([counts, rows.unsqueeze(0)]).detach()
    if group is not None:
        dist.all_reduce(totals, group=group)
    shares, total_rows = totals[:num_experts] / totals[num_experts], totals[num_experts]
    return model.router_aux_loss_coef * num_experts * torch.sum(shares * probability_sums / total_rows)
