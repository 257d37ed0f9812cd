"""Compressing adapter updates: top-k sparsification with error feedback, optional int8 (the
tensor functions are lab.sparse's; the wire format is this module's).

A client sends its update (delta from the global adapter) as the k largest-magnitude entries
of each tensor; what it did not send is kept as a residual and added to its next update
(error feedback, Seide et al. 2014; Stich et al. 2018), so nothing is lost, only delayed.
`topk_int8` also quantizes each tensor's kept values to int8 with one float32 scale per tensor.

On the wire a compressed update is packed into three tensors, whatever the number of adapter
tensors (a LoRA adapter has two per wrapped module, and per-tensor headers would cost as much
as the values they carry): `idx` (int32 indices into the adapter's tensors laid end to end in
sorted-name order), `val` (float32, or int8) and, for int8, `scale` (float32, one per tensor
in the same order). The receiver knows the adapter's layout and checks every index against it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lab.sparse import quantize_int8, topk
from netproto.errors import peer_text

COMPRESSIONS = ("none", "topk", "topk_int8")
MAX_PACKED = 2**31 - 1
"""Indices are int32: adapters up to 2^31 - 1 entries."""


def compress(
    update: Mapping[str, torch.Tensor], *, method: str, fraction: float
) -> dict[str, torch.Tensor]:
    """Wire tensors for `update` (see the module docstring)."""
    if method not in COMPRESSIONS:
        raise ValueError(f"compression={method!r}: choose one of {list(COMPRESSIONS)}")
    if method == "none":
        return dict(update)
    indices, values, scales = [], [], []
    offset = 0
    for name in sorted(update):
        delta = update[name]
        kept, vals = topk(delta, fraction=fraction)
        indices.append(kept.long() + offset)
        if method == "topk_int8":
            vals, scale = quantize_int8(vals)
            scales.append(scale)
        values.append(vals)
        offset += delta.numel()
    if offset > MAX_PACKED:
        raise ValueError(f"an update of {offset} entries is too big for int32 indices")
    wire = {"idx": torch.cat(indices).to(torch.int32), "val": torch.cat(values)}
    if method == "topk_int8":
        wire["scale"] = torch.stack(scales)
    return wire


def decompress(
    wire: Mapping[str, torch.Tensor], *, method: str, shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """The dense update from wire tensors; `shapes` (the global adapter's) bounds every index.

    ValueError for anything that does not fit the layout: missing or extra tensors, indices
    out of range or unpaired with values, a scale count that is not one per tensor.
    """
    if method == "none":
        return {name: wire[name] for name in shapes}
    names = sorted(shapes)
    sizes = [torch.Size(shapes[name]).numel() for name in names]
    expected = {"idx", "val", "scale"} if method == "topk_int8" else {"idx", "val"}
    if set(wire) != expected:
        raise ValueError(
            f"a {method} update has tensors {sorted(expected)}, not {len(wire)} tensors "
            f"named {peer_text(sorted(wire)[:4], limit=200)}"
        )
    indices, values = wire["idx"], wire["val"]
    if indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel():
        raise ValueError("compressed indices and values must be 1-D and paired")
    if indices.dtype != torch.int32:
        raise ValueError(f"compressed indices must be int32, not {indices.dtype}")
    indices = indices.long()
    total = sum(sizes)
    if indices.numel() and (indices.min() < 0 or indices.max() >= total):
        raise ValueError(f"compressed indices out of range for an adapter of {total} entries")
    values = values.float()
    if method == "topk_int8":
        scale = wire["scale"].float().reshape(-1)
        if scale.numel() != len(names):
            raise ValueError(f"{scale.numel()} int8 scales for {len(names)} adapter tensors")
        ends = torch.tensor(sizes).cumsum(0)
        values = values * scale[torch.searchsorted(ends, indices, right=True)]
    flat = torch.zeros(total, dtype=torch.float32)
    flat[indices] = values
    return {
        name: part.view(shapes[name]) for name, part in zip(names, flat.split(sizes), strict=True)
    }


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
