"""Top-k sparsification and int8 quantization of tensors, with error feedback: the pure tensor
functions that fed_learn's update compression and data_parallel's top-k communication hook
share (no wire format here: each packs what it sends its own way).

Error feedback (Seide et al. 2014; Stich et al. 2018): what a round did not send is kept and
added to the next round's values, so nothing is lost, only delayed.
"""

from __future__ import annotations

import torch


def topk(delta: torch.Tensor, *, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat int32 indices, float32 values) of the ceil(fraction * numel) largest |entries|."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]")
    flat = delta.reshape(-1).float()
    k = max(1, min(flat.numel(), int(-(-fraction * flat.numel() // 1))))
    indices = flat.abs().topk(k, sorted=False).indices
    return indices.to(torch.int32), flat[indices]


def quantize_int8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: values ~= q * scale with |error| <= scale / 2."""
    peak = values.abs().max() if values.numel() else torch.tensor(0.0)
    scale = (peak / 127.0).clamp_min(1e-12).float()
    return (values / scale).round().clamp(-127, 127).to(torch.int8), scale.reshape(())


def sparse_with_feedback(
    values: torch.Tensor, residual: torch.Tensor, *, fraction: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of `values + residual` (flat): (indices, kept values, the new residual), where
    the kept values laid out at their indices plus the new residual is `values + residual`
    exactly (the residual is what was not sent, not an approximation of it)."""
    corrected = values.reshape(-1).float() + residual.reshape(-1).float()
    indices, kept = topk(corrected, fraction=fraction)
    remaining = corrected.clone()
    remaining[indices.long()] = 0.0
    return indices, kept, remaining
