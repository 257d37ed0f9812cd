"""How the drafter's distributions q travel with its tokens when sampling, and how the verifier
takes them back: pure functions over tensors, no sockets.

The speculative sampling rule needs q(x) wherever the target's p may exceed it: q's whole row.
A drafter with top-p or top-k samples from a q that is zero almost everywhere, so only q's
support travels, and as integers: each probability becomes a weight w >= 1 with the weights of
a row summing to exactly 2^16 (largest remainders; an entry whose share rounds to nothing
leaves the support). The drafter samples from q' = w / 2^16 and sends w, and w / 2^16 is exact
in float32 on any machine, so the verifier's q is bit for bit the one the drafter sampled from,
whatever either side's float kernels, and the rule stays exact.

Per message, for k drafted tokens and n support entries in all:

    "q_rows"   int32 (k,)    entries per row
    "q_weight" uint16 (n,)   w - 1 (so that w = 2^16, a certain token, fits)
    "q_gap"    uint8 (>= n)  the indices, ascending within each row, as gaps: g = index -
                             previous index - 1 (the first of a row from -1), written as
                             g // 255 bytes of 255 then one byte g % 255 (under 255)

About 3 bytes per entry. A dense float32 row (`"q": (k, V)`) is still accepted.
"""

from __future__ import annotations

import torch

Q_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dense q may come in these (float8/float4 have no arithmetic to check them with)."""
Q_SUM_TOLERANCE = 1e-3
"""A dense row must sum to 1 within this."""
WEIGHT_BITS = 16
TOTAL = 1 << WEIGHT_BITS
"""Every row's integer weights sum to exactly this."""
ESCAPE = 255
SPARSE_KEYS = ("q_rows", "q_weight", "q_gap")


class BadDraftQ(ValueError):
    """A q the protocol carried but that the rule cannot take."""


def quantize(q: torch.Tensor) -> torch.Tensor:
    """(k, V) probabilities -> (k, V) int64 weights, each row summing to exactly 2^16 (largest
    remainders). The distribution the drafter then samples from is `weights / 2^16`."""
    scaled = q.double() * TOTAL
    weights = scaled.floor().long()
    short = TOTAL - weights.sum(dim=-1)  # (k,): 0 <= short < entries with a remainder
    remainder = scaled - weights
    order = remainder.argsort(dim=-1, descending=True)  # (k, V)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(q.size(-1)).expand_as(order))
    return weights + (rank < short[:, None]).long()


def as_probabilities(weights: torch.Tensor) -> torch.Tensor:
    """Integer weights (summing to 2^16 per row) -> float32 probabilities, exactly."""
    return weights.float() * (1.0 / TOTAL)


def encode_q(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """(k, V) integer weights (see `quantize`) as the TENSORS entries to send."""
    rows, index = (weights > 0).nonzero(as_tuple=True)  # row-major: ascending within each row
    counts = (weights > 0).sum(dim=-1)  # (k,)
    previous = torch.cat([torch.tensor([-1]), index[:-1]])
    first = torch.ones_like(index, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    previous[first] = -1
    gaps = index - previous - 1  # (n,) >= 0
    if not gaps.numel() or int(gaps.max()) < ESCAPE:  # the usual case: a byte each
        encoded = gaps.to(torch.uint8)
    else:
        raw = bytearray()
        for gap in gaps.tolist():
            escapes, rest = divmod(gap, ESCAPE)
            raw += b"\xff" * escapes
            raw.append(rest)
        encoded = torch.frombuffer(raw, dtype=torch.uint8)
    return {
        "q_rows": counts.to(torch.int32),
        "q_weight": (weights[rows, index] - 1).to(torch.uint16),
        "q_gap": encoded,
    }


def decode_q(payload: dict[str, torch.Tensor], draft: list[int], vocab_size: int) -> torch.Tensor:
    """The (k, V) float32 q rows of a DRAFT or STREAM, checked: each a distribution that gives
    its own drafted token a positive probability (q <= 0 would let the rule accept anything).
    Raises BadDraftQ naming what is wrong."""
    k = len(draft)
    if "q" in payload:
        if any(name in payload for name in SPARSE_KEYS):
            raise BadDraftQ("send q dense (`q`) or as weights (`q_rows`, `q_weight`, `q_gap`)")
        q = payload["q"]
        if tuple(q.shape) != (k, vocab_size):
            raise BadDraftQ("sampling needs `q` of shape (k, vocab_size)")
        if q.dtype not in Q_DTYPES:
            raise BadDraftQ("`q` must hold float16, bfloat16, float32 or float64 probabilities")
        q = q.float()
        if not torch.isfinite(q).all() or (q < 0).any():
            raise BadDraftQ("`q` must hold finite, non-negative probabilities")
        if ((q.sum(dim=-1) - 1).abs() > Q_SUM_TOLERANCE).any():
            raise BadDraftQ("each row of `q` must sum to 1")
    else:
        q = _decode_weights(payload, k, vocab_size)
    if k and (q[torch.arange(k), torch.tensor(draft)] <= 0).any():
        raise BadDraftQ("`q` gives a drafted token no probability")
    return q


def _decode_weights(payload: dict[str, torch.Tensor], k: int, vocab_size: int) -> torch.Tensor:
    rows, weight, gap = (payload.get(name) for name in SPARSE_KEYS)
    if rows is None or weight is None or gap is None:
        raise BadDraftQ(
            "sampling needs q: `q` (k, vocab_size), or `q_rows`, `q_weight` and `q_gap`"
        )
    if rows.dtype != torch.int32 or tuple(rows.shape) != (k,):
        raise BadDraftQ("`q_rows` must be int32 of shape (k,)")
    if weight.dtype != torch.uint16 or weight.dim() != 1:
        raise BadDraftQ("`q_weight` must be a uint16 vector")
    if gap.dtype != torch.uint8 or gap.dim() != 1:
        raise BadDraftQ("`q_gap` must be a uint8 vector")
    counts = rows.to(torch.int64)
    if k and ((counts < 1).any() or (counts > vocab_size).any()):
        raise BadDraftQ(f"each row of q holds 1..{vocab_size} entries")
    entries = int(counts.sum())
    if weight.numel() != entries:
        raise BadDraftQ("`q_rows` must add up to the entries of `q_weight`")
    if gap.numel() > entries * (1 + vocab_size // ESCAPE):  # more than any index could need
        raise BadDraftQ("`q_gap` is longer than its indices could need")
    ends = gap != ESCAPE  # each index ends at its first byte below 255
    if int(ends.sum()) != entries or (entries and not bool(ends[-1])):
        raise BadDraftQ("`q_gap` must hold exactly one index per entry")
    # index = (sum of its row's gap bytes so far) + (its place in the row)
    total = gap.to(torch.int64).cumsum(0)[ends]  # (n,): bytes summed up to each index's end
    row_of = torch.repeat_interleave(torch.arange(k), counts)  # (n,)
    row_start = torch.cumsum(counts, 0) - counts  # (k,): first entry of each row
    before = torch.cat([torch.zeros(1, dtype=torch.int64), total])[row_start]  # (k,)
    place = torch.arange(entries) - row_start[row_of]
    index = total - before[row_of] + place
    if entries and int(index.max()) >= vocab_size:
        raise BadDraftQ(f"`q_gap` leads to ids outside 0..{vocab_size - 1}")
    weights = weight.to(torch.int64) + 1
    sums = torch.zeros(k, dtype=torch.int64).index_add_(0, row_of, weights)
    if (sums != TOTAL).any():
        raise BadDraftQ(f"each row's weights must sum to exactly {TOTAL}")
    q = torch.zeros(k, vocab_size)
    q[row_of, index] = as_probabilities(weights)
    return q
