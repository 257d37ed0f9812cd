"""The next-token loss every experiment trains and evaluates with, and the evaluation of a model
on held-out blocks (a pretraining run's, a federated coordinator's and its clients')."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""A label that counts for nothing (padding), as Hugging Face models use it."""


def next_token_loss(
    logits: torch.Tensor, ids: torch.Tensor, *, reduction: Literal["mean", "sum"] = "mean"
) -> torch.Tensor:
    """Cross-entropy of each position's prediction of the next id.

    `logits`: (B, T, V), the model's output on `ids` (B, T); the last position predicts nothing
    and a next id of IGNORE_INDEX does not count. Computed in float32 whatever the logits' dtype.
    """
    vocab = logits.shape[-1]
    shifted = logits[:, :-1].float().reshape(-1, vocab)  # (B*(T-1), V)
    targets = ids[:, 1:].reshape(-1).to(logits.device)  # (B*(T-1),)
    return F.cross_entropy(shifted, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, *, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over `blocks` (moved, a batch at a time, to the
    model's device: a coordinator's model may sit on a GPU while its data is on the CPU)."""
    model.eval()
    device = device_of(model)
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = blocks[start : start + batch_size].to(device)
        logits = model(input_ids=batch).logits  # (B, T, V)
        total += next_token_loss(logits, batch, reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count
