"""A few optimizer steps on a model's own loss: what many tests compare across strategies."""

from __future__ import annotations

import torch


def train_steps(model, optimizer: torch.optim.Optimizer, ids: torch.Tensor, count: int) -> list[float]:
    """``count`` steps of ``optimizer`` on ``model``'s loss of predicting ``ids``; the losses."""
    losses = []
    for _ in range(count):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
