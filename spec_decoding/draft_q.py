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

    "q_rows"   int32 (k,)   entries per row
    "q_index"  uint8 (...)  n varints: each index less the previous one in its row, less 1
                            (the first of a row counts from -1), ascending within a row
    "q_weight" uint8 (...)  n varints: w - 1 (0..65535)

A varint is LEB128: 7 bits a byte, low bits first, the high bit set on every byte but the last.
A nucleus's indices lie close together and most of its weights are small, so an entry costs
about two and a half bytes. A dense float32 row (`"q": (k, V)`) is still accepted.
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
MAX_VARINT_BYTES = 5
"""Enough for any index below 2^35 and any weight: a longer varint is refused."""
SPARSE_KEYS = ("q_rows", "q_index", "q_weight")


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
    places = torch.arange(q.size(-1), device=q.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, places)
    return weights + (rank < short[:, None]).long()


def as_probabilities(weights: torch.Tensor) -> torch.Tensor:
    """Integer weights (summing to 2^16 per row) -> float32 probabilities, exactly."""
    return weights.float() * (1.0 / TOTAL)


def to_varints(values: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 values (n,) -> their LEB128 bytes, in order (uint8)."""
    values = values.to(torch.int64)
    lengths = torch.ones_like(values)
    for shift in range(7, 7 * MAX_VARINT_BYTES, 7):
        lengths += (values >> shift) > 0
    owner = torch.repeat_interleave(torch.arange(values.numel()), lengths)  # byte -> value
    starts = torch.cumsum(lengths, 0) - lengths
    place = torch.arange(int(lengths.sum())) - starts[owner]  # byte's place in its varint
    more = place < lengths[owner] - 1
    return (((values[owner] >> (7 * place)) & 0x7F) | (more.long() << 7)).to(torch.uint8)


def from_varints(data: torch.Tensor, count: int, what: str) -> torch.Tensor:
    """LEB128 bytes (uint8) -> exactly `count` int64 values; BadDraftQ if they are not that."""
    raw = data.to(torch.int64)
    last = (raw & 0x80) == 0  # the final byte of each varint
    if int(last.sum()) != count or (raw.numel() and not bool(last[-1])):
        raise BadDraftQ(f"`{what}` must hold exactly {count} varints")
    owner = torch.cumsum(last.long(), 0) - last.long()  # byte -> its varint
    starts = torch.zeros(count, dtype=torch.int64)
    starts[1:] = torch.nonzero(last).squeeze(-1)[:-1] + 1
    place = torch.arange(raw.numel()) - starts[owner]
    if raw.numel() and int(place.max()) >= MAX_VARINT_BYTES:
        raise BadDraftQ(f"`{what}` holds a varint longer than {MAX_VARINT_BYTES} bytes")
    parts = (raw & 0x7F) << (7 * place)
    return torch.zeros(count, dtype=torch.int64).index_add_(0, owner, parts)


def encode_q(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """(k, V) integer weights (see `quantize`) as the TENSORS entries to send."""
    support = weights > 0
    rows, index = support.nonzero(as_tuple=True)  # row-major: ascending within each row
    previous = torch.cat([torch.tensor([-1]), index[:-1]])
    previous[1:][rows[1:] != rows[:-1]] = -1  # each row's first index counts from -1
    return {
        "q_rows": support.sum(dim=-1).to(torch.int32),
        "q_index": to_varints(index - previous - 1),
        "q_weight": to_varints(weights[rows, index] - 1),
    }


def decode_q(payload: dict[str, torch.Tensor], draft: list[int], vocab_size: int) -> torch.Tensor:
    """The (k, V) float32 q rows of a DRAFT or STREAM, checked: each a distribution that gives
    its own drafted token a positive probability (q <= 0 would let the rule accept anything).
    Raises BadDraftQ naming what is wrong."""
    k = len(draft)
    if "q" in payload:
        if any(name in payload for name in SPARSE_KEYS):
            raise BadDraftQ("send q dense (`q`) or as weights (`q_rows`, `q_index`, `q_weight`)")
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
    rows, index_bytes, weight_bytes = (payload.get(name) for name in SPARSE_KEYS)
    if rows is None or index_bytes is None or weight_bytes is None:
        raise BadDraftQ(
            "sampling needs q: `q` (k, vocab_size), or `q_rows`, `q_index` and `q_weight`"
        )
    if rows.dtype != torch.int32 or tuple(rows.shape) != (k,):
        raise BadDraftQ("`q_rows` must be int32 of shape (k,)")
    for name, data in (("q_index", index_bytes), ("q_weight", weight_bytes)):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise BadDraftQ(f"`{name}` must be a uint8 vector of varints")
    counts = rows.to(torch.int64)
    if k and ((counts < 1).any() or (counts > vocab_size).any()):
        raise BadDraftQ(f"each row of q holds 1..{vocab_size} entries")
    entries = int(counts.sum())
    for name, data in (("q_index", index_bytes), ("q_weight", weight_bytes)):
        if data.numel() > entries * MAX_VARINT_BYTES:
            raise BadDraftQ(f"`{name}` is longer than {entries} varints can be")
    gaps = from_varints(index_bytes, entries, "q_index")
    weights = from_varints(weight_bytes, entries, "q_weight") + 1
    if entries and int(weights.max()) > TOTAL:
        raise BadDraftQ(f"`q_weight` holds a weight over {TOTAL}")
    # index = its row's gaps so far + its place in the row (each step is gap + 1)
    row_of = torch.repeat_interleave(torch.arange(k), counts)  # (n,)
    row_start = torch.cumsum(counts, 0) - counts  # (k,): first entry of each row
    steps = torch.cumsum(gaps + 1, 0)  # (n,)
    before = torch.cat([torch.zeros(1, dtype=torch.int64), steps])[row_start]  # (k,)
    index = steps - before[row_of] - 1
    if entries and int(index.max()) >= vocab_size:
        raise BadDraftQ(f"`q_index` leads to ids outside 0..{vocab_size - 1}")
    sums = torch.zeros(k, dtype=torch.int64).index_add_(0, row_of, weights)
    if (sums != TOTAL).any():
        raise BadDraftQ(f"each row's weights must sum to exactly {TOTAL}")
    q = torch.zeros(k, vocab_size)
    q[row_of, index] = as_probabilities(weights)
    return q
