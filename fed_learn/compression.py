"""Compressing adapter updates: top-k sparsification with error feedback, optional int8.

A client sends its update (delta from the global adapter) as the k largest-magnitude entries
of each tensor; what it did not send is kept as a residual and added to its next update
(error feedback, Seide et al. 2014; Stich et al. 2018), so nothing is lost, only delayed.
`topk_int8` also quantizes the kept values to int8 with one float32 scale per tensor.
On the wire a compressed tensor `w` is three tensors: `w.idx` (int32 flat indices), `w.val`
(float32 or int8) and, for int8, `w.scale` (float32 scalar).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

COMPRESSIONS = ("none", "topk", "topk_int8")


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


def compress(
    update: Mapping[str, torch.Tensor], *, method: str, fraction: float
) -> dict[str, torch.Tensor]:
    """Wire tensors for `update` (see the module docstring)."""
    if method not in COMPRESSIONS:
        raise ValueError(f"compression={method!r}: choose one of {list(COMPRESSIONS)}")
    if method == "none":
        return dict(update)
    wire: dict[str, torch.Tensor] = {}
    for name, delta in update.items():
        indices, values = topk(delta, fraction=fraction)
        wire[f"{name}.idx"] = indices
        if method == "topk_int8":
            wire[f"{name}.val"], wire[f"{name}.scale"] = quantize_int8(values)
        else:
            wire[f"{name}.val"] = values
    return wire


def decompress(
    wire: Mapping[str, torch.Tensor], *, method: str, shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """The dense update from wire tensors; `shapes` (the global adapter's) bounds every index."""
    if method == "none":
        return {name: wire[name] for name in shapes}
    dense: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        indices = wire[f"{name}.idx"].long()
        values = wire[f"{name}.val"].float()
        if method == "topk_int8":
            values = values * wire[f"{name}.scale"].float()
        flat = torch.zeros(torch.Size(shape).numel(), dtype=torch.float32)
        if indices.numel() != values.numel() or (
            indices.numel() and (indices.min() < 0 or indices.max() >= flat.numel())
        ):
            raise ValueError(f"{name}: compressed indices out of range or unpaired")
        flat[indices] = values
        dense[name] = flat.view(shape)
    return dense


class ErrorFeedback:
    """A client's memory of what it has not sent yet."""

    def __init__(self) -> None:
        self.residual: dict[str, torch.Tensor] = {}

    def compress(
        self, update: Mapping[str, torch.Tensor], *, method: str, fraction: float
    ) -> dict[str, torch.Tensor]:
        corrected = {
            name: delta.float() + self.residual.get(name, 0.0) for name, delta in update.items()
        }
        wire = compress(corrected, method=method, fraction=fraction)
        sent = decompress(
            wire, method=method, shapes={name: t.shape for name, t in corrected.items()}
        )
        self.residual = {name: corrected[name] - sent[name] for name in corrected}
        return wire


def wire_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data a set of wire tensors occupies (headers not included)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
