"""Token sampling shared by every experiment that generates: temperature and nucleus (top-p)."""

from __future__ import annotations

import torch


def probs_from_logits(
    logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int = 0
) -> torch.Tensor:
    """Next-token distributions (..., V) after temperature, then top-k (0: off), then nucleus
    (top-p) filtering."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if 0 < top_k < probs.size(-1):
        kth = probs.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        probs = probs * (probs >= kth)  # ties at the k-th value stay: at least k kept
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    keep_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = probs * keep
    return filtered / filtered.sum(dim=-1, keepdim=True)
