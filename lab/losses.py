"""The next-token loss every experiment trains and evaluates with."""

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
