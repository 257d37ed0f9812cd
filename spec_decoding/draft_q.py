"""How the drafter's distributions q travel with its tokens when sampling, and how the verifier
takes them back: pure functions over tensors, no sockets.

The speculative sampling rule needs q(x) for every x where the target's p may exceed it, which
is q's whole row. But a drafter with top-p or top-k samples from a q that is zero almost
everywhere, so it sends only q's support: for each drafted token the indices where q > 0
(ascending) and q's values there, float32 as the drafter computed them, so the verifier's q is
exactly the q the drafter sampled from and the rule stays exact. A row whose support is most
of the vocabulary goes dense, whichever is smaller.

    dense   "q": float32 (k, V)
    sparse  "q_rows": int32 (k,) entries per row, "q_index": uint16 or int32 (n,), ascending
            within a row, "q_value": float32 (n,) > 0, each row summing to 1
"""

from __future__ import annotations

import torch

Q_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dense q may come in these (float8/float4 have no arithmetic to check them with)."""
Q_SUM_TOLERANCE = 1e-3


class BadDraftQ(ValueError):
    """A q the protocol carried but that the rule cannot take."""


def index_dtype(vocab_size: int) -> torch.dtype:
    """The narrowest index type for a vocabulary: uint16 up to 65,536 entries."""
    return torch.uint16 if vocab_size <= 2**16 else torch.int32


def encode_q(q: torch.Tensor) -> dict[str, torch.Tensor]:
    """`q` (k, V) float32 as the TENSORS entries to send: its support, or dense if smaller."""
    k, vocab = q.shape
    q = q.float()
    support = q > 0  # (k, V)
    entries = int(support.sum())
    dtype = index_dtype(vocab)
    sparse_bytes = entries * (4 + dtype.itemsize) + 4 * k
    if sparse_bytes >= 4 * k * vocab:
        return {"q": q.contiguous()}
    rows, index = support.nonzero(as_tuple=True)  # row-major: ascending within each row
    return {
        "q_rows": support.sum(dim=-1).to(torch.int32),  # (k,)
        "q_index": index.to(dtype),  # (n,)
        "q_value": q[rows, index].contiguous(),  # (n,)
    }


def decode_q(payload: dict[str, torch.Tensor], draft: list[int], vocab_size: int) -> torch.Tensor:
    """The (k, V) float32 q rows of a DRAFT or STREAM, checked: each a distribution that gives
    its own drafted token a positive probability (q <= 0 would let the rule accept anything).
    Raises BadDraftQ naming what is wrong."""
    k = len(draft)
    if "q" in payload:
        if any(name in payload for name in ("q_rows", "q_index", "q_value")):
            raise BadDraftQ("send q dense (`q`) or sparse (`q_rows`, `q_index`, `q_value`)")
        q = payload["q"]
        if tuple(q.shape) != (k, vocab_size):
            raise BadDraftQ("sampling needs `q` of shape (k, vocab_size)")
        if q.dtype not in Q_DTYPES:
            raise BadDraftQ("`q` must hold float16, bfloat16, float32 or float64 probabilities")
        q = q.float()
    else:
        q = _decode_sparse(payload, k, vocab_size)
    if not torch.isfinite(q).all() or (q < 0).any():
        raise BadDraftQ("`q` must hold finite, non-negative probabilities")
    if ((q.sum(dim=-1) - 1).abs() > Q_SUM_TOLERANCE).any():
        raise BadDraftQ("each row of `q` must sum to 1")
    if k and (q[torch.arange(k), torch.tensor(draft)] <= 0).any():
        raise BadDraftQ("`q` gives a drafted token no probability")
    return q


def _decode_sparse(payload: dict[str, torch.Tensor], k: int, vocab_size: int) -> torch.Tensor:
    rows, index, value = (payload.get(name) for name in ("q_rows", "q_index", "q_value"))
    if rows is None or index is None or value is None:
        raise BadDraftQ("sampling needs q: `q` (k, vocab_size), or `q_rows`, `q_index`, `q_value`")
    if rows.dtype != torch.int32 or tuple(rows.shape) != (k,):
        raise BadDraftQ("`q_rows` must be int32 of shape (k,)")
    if index.dtype not in (torch.uint16, torch.int32) or index.dim() != 1:
        raise BadDraftQ("`q_index` must be a uint16 or int32 vector")
    if value.dtype != torch.float32 or value.dim() != 1 or value.numel() != index.numel():
        raise BadDraftQ("`q_value` must be a float32 vector as long as `q_index`")
    counts = rows.to(torch.int64)
    if k and ((counts < 1).any() or (counts > vocab_size).any()):
        raise BadDraftQ(f"each row of q holds 1..{vocab_size} entries")
    if int(counts.sum()) != index.numel():
        raise BadDraftQ("`q_rows` must add up to the entries of `q_index`")
    index = index.to(torch.int64)
    if index.numel() and (index.min() < 0 or index.max() >= vocab_size):
        raise BadDraftQ(f"`q_index` holds ids outside 0..{vocab_size - 1}")
    row_of = torch.repeat_interleave(torch.arange(k), counts)  # (n,)
    # strictly ascending within a row: no index twice, so no entry overwrites another
    same_row = row_of[1:] == row_of[:-1]
    if (same_row & (index[1:] <= index[:-1])).any():
        raise BadDraftQ("`q_index` must ascend strictly within each row")
    if not torch.isfinite(value).all() or (value <= 0).any():
        raise BadDraftQ("`q_value` must hold finite, positive probabilities")
    q = torch.zeros(k, vocab_size)
    q[row_of, index] = value
    return q
