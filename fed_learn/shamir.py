"""Rebuilding many Shamir secrets at once, over pycryptodome's field: byte for byte what
`Crypto.Protocol.SecretSharing.Shamir.combine` returns, at a fraction of the cost.

pycryptodome shares 16-byte secrets over GF(2^128) (the polynomial 1 + x + x^2 + x^7 + x^128,
an element read from its 16 bytes big-endian, the lowest bit the constant term). Its `combine`
works out the Lagrange basis again for every secret (k^2 products and k inversions) and
multiplies in pure Python, about 100 us a product. A secure round's coordinator rebuilds a
hundred secrets over a handful of index sets, so here:

- the basis is taken once per index set (kept in a cache of at most BASIS_CACHE_ELEMENTS field
  elements, least recently used out first): the numerators and denominators are products
  of share indices (small polynomials), carry-less in Python ints, then one of pycryptodome's
  inversions for the whole set (Montgomery's trick) and a few products per basis element;
- the products share x basis weight, every secret's at once, are one batch of carry-less
  multiplications in numpy (two uint64 words an element, 128 shift-and-xor steps for the whole
  batch), reduced modulo the field's polynomial as they go.

The coordinator is the party that learns these secrets, so the arithmetic need not hide them
from timing (pycryptodome's masks guard the dealer's side, `Shamir.split`, which stays the
library's). Equality with `Shamir.combine` on random subsets is tested.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from Crypto.Protocol.SecretSharing import _Element

SHARE_BYTES = 16
_POLY = (1 << 128) | 0x87
"""The field's polynomial: x^128 + x^7 + x^2 + x + 1."""
_LOW_POLY = np.uint64(0x87)
_ONE = np.uint64(1)
_TOP = np.uint64(63)

Share = tuple[int, bytes]
"""(Shamir index, 16-byte share), as pycryptodome's `Shamir.split` gives them."""


def _clmul(a: int, b: int) -> int:
    """The carry-less product of two polynomials over GF(2), reduced modulo the field's."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        if a >> 128:
            a ^= _POLY
        b >>= 1
    return product


BASIS_CACHE_ELEMENTS = 1 << 17
"""The most share indices and basis elements the cache of bases holds, all bases together
(~6 MB as Python ints and tuples); a basis that alone is more is not kept. Bounded by count
alone (4,096 bases, however large), 4,096 bases of 1,000 shares held ~0.36 GB for good."""


class _Bases:
    """Lagrange bases by index set, least recently used out first, at most
    BASIS_CACHE_ELEMENTS elements (indices and weights) in all."""

    def __init__(self) -> None:
        self._held: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.elements = 0

    def get(self, indices: tuple[int, ...]) -> tuple[int, ...] | None:
        with self._lock:
            weights = self._held.get(indices)
            if weights is not None:
                self._held.move_to_end(indices)
            return weights

    def put(self, indices: tuple[int, ...], weights: tuple[int, ...]) -> None:
        size = 2 * len(indices)
        with self._lock:
            if size > BASIS_CACHE_ELEMENTS or indices in self._held:
                return
            self._held[indices] = weights
            self.elements += size
            while self.elements > BASIS_CACHE_ELEMENTS:
                self.elements -= 2 * len(self._held.popitem(last=False)[0])

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self.elements = 0


BASES = _Bases()


def basis(indices: tuple[int, ...]) -> tuple[int, ...]:
    """The Lagrange basis at 0 for these share indices (cached in `BASES`)."""
    weights = BASES.get(indices)
    if weights is None:
        weights = lagrange(indices)
        BASES.put(indices, weights)
    return weights


def lagrange(indices: tuple[int, ...]) -> tuple[int, ...]:
    """The Lagrange basis at 0 for these share indices, as field elements (ints):
    w_j = prod_{m != j} x_m / prod_{m != j} (x_j + x_m) (addition is subtraction here):
    len(indices)^2 small products and one field inversion."""
    numerators, denominators = [], []
    for j, x_j in enumerate(indices):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = _clmul(numerator, x_m)
                denominator = _clmul(denominator, x_j ^ x_m)
        numerators.append(numerator)
        denominators.append(denominator)
    return tuple(
        _clmul(inverse, numerator)  # the small factor second: its bits are the loop
        for inverse, numerator in zip(_inverses(denominators), numerators, strict=True)
    )


def _inverses(values: Sequence[int]) -> list[int]:
    """Every (non-zero) value's inverse for one of pycryptodome's field inversions, the
    costly step (Montgomery's trick): invert the product of all, then peel each off."""
    prefix = [1]
    for value in values:
        prefix.append(_clmul(prefix[-1], value))
    inverse = int(_Element(prefix[-1]).inverse())  # 1 / (v_0 ... v_{n-1})
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = _clmul(inverse, prefix[i])  # 1 / v_i
        inverse = _clmul(inverse, values[i])  # 1 / (v_0 ... v_{i-1})
    return out


def multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise products in GF(2^128) of two (N, 2) uint64 arrays ([high, low] words)."""
    v_high, v_low = a[:, 0].copy(), a[:, 1].copy()
    z_high, z_low = np.zeros_like(v_high), np.zeros_like(v_low)
    for word in (b[:, 1], b[:, 0]):  # x^0..x^63 first, then x^64..x^127
        for bit in range(64):
            take = np.negative((word >> np.uint64(bit)) & _ONE)  # 0 or all ones
            z_high ^= v_high & take
            z_low ^= v_low & take
            carry = v_high >> _TOP  # v * x, reduced: x^128 = x^7 + x^2 + x + 1
            v_high = (v_high << _ONE) | (v_low >> _TOP)
            v_low = (v_low << _ONE) ^ (carry * _LOW_POLY)
    return np.stack([z_high, z_low], axis=1)


def _check(indices: tuple[int, ...]) -> None:
    if len(set(indices)) != len(indices) or not all(0 < i < 2**16 for i in indices):
        raise ValueError(f"share indices {indices} must be distinct, in 1..65535")


def combine_many(groups: Sequence[Sequence[Share]]) -> list[bytes]:
    """`[Shamir.combine(group) for group in groups]`, its field products in one batch."""
    if not groups:
        return []
    weights: list[int] = []
    blobs: list[bytes] = []
    starts: list[int] = []
    taken: dict[tuple[int, ...], tuple[int, ...]] = {}  # this batch's bases, cached or not
    for group in groups:
        indices = tuple(index for index, _ in group)
        _check(indices)
        if not group or not all(len(share) == SHARE_BYTES for _, share in group):
            raise ValueError(f"a group of {SHARE_BYTES}-byte shares, at least one")
        starts.append(len(weights))
        if indices not in taken:
            taken[indices] = basis(indices)
        weights += taken[indices]
        blobs += [share for _, share in group]
    shares = np.frombuffer(b"".join(blobs), dtype=">u8").astype(np.uint64).reshape(-1, 2)
    packed = b"".join(w.to_bytes(SHARE_BYTES, "big") for w in weights)
    factors = np.frombuffer(packed, dtype=">u8").astype(np.uint64).reshape(-1, 2)
    products = multiply(shares, factors)  # (sum of group sizes, 2)
    secrets = np.bitwise_xor.reduceat(products, starts, axis=0)  # (groups, 2)
    raw = secrets.astype(">u8").tobytes()
    return [raw[i : i + SHARE_BYTES] for i in range(0, len(raw), SHARE_BYTES)]


def combine(shares: Sequence[Share]) -> bytes:
    """`Shamir.combine(shares)`."""
    return combine_many([shares])[0]


def combine_pieces(groups: Sequence[Sequence[Share]], *, pieces: int) -> list[bytes]:
    """Secrets of `pieces` 16-byte Shamir secrets each (a 32-byte key is two), shared
    side by side: each share's bytes hold one share of every piece, in order."""
    split = [
        [(index, share[p * SHARE_BYTES : (p + 1) * SHARE_BYTES]) for index, share in group]
        for p in range(pieces)
        for group in groups
    ]
    rebuilt = combine_many(split)  # every group's first piece, then every group's second...
    count = len(groups)
    return [b"".join(rebuilt[p * count + g] for p in range(pieces)) for g in range(count)]


def _words(values: Sequence[int]) -> np.ndarray:
    """Field elements (ints) as an (N, 2) uint64 array ([high, low] words)."""
    packed = b"".join(v.to_bytes(SHARE_BYTES, "big") for v in values)
    return np.frombuffer(packed, dtype=">u8").astype(np.uint64).reshape(-1, 2)


def leave_one_out(shares: Sequence[Share], *, pieces: int = 1) -> list[bytes]:
    """`[combine_pieces([shares without shares[r]], pieces=pieces)[0] for r in ...]`: every
    secret that leaves one share out, for one basis's work (of all the shares) instead of one
    basis per share left out.

    With w_j the basis of the whole set S and y_j the shares, the set without x_r has basis
    w_j (x_j + x_r) / x_r (x_r leaves the numerator's product, x_j + x_r the denominator's), so
    its secret is sum_j w_j y_j (x_j + x_r) / x_r (the j = r term is 0) = A + X / x_r, with
    A = sum_j w_j y_j (S's own secret) and X = sum_j x_j w_j y_j: 3 |S| field products a piece.
    """
    indices = tuple(index for index, _ in shares)
    _check(indices)
    size = pieces * SHARE_BYTES
    if len(shares) < 2 or not all(len(share) == size for _, share in shares):
        raise ValueError(f"at least two shares of {size} bytes to leave one out")
    weights, xs = _words(basis(indices)), _words(indices)
    inverses = _words(_inverses(indices))  # 1 / x_r
    out = [b""] * len(shares)
    for p in range(pieces):
        ys = b"".join(share[p * SHARE_BYTES : (p + 1) * SHARE_BYTES] for _, share in shares)
        values = np.frombuffer(ys, dtype=">u8").astype(np.uint64).reshape(-1, 2)
        terms = multiply(values, weights)  # w_j y_j
        whole = np.bitwise_xor.reduce(terms, axis=0)  # A
        moment = np.bitwise_xor.reduce(multiply(terms, xs), axis=0)  # X
        each = multiply(np.repeat(moment[None, :], len(shares), axis=0), inverses) ^ whole
        raw = each.astype(">u8").tobytes()
        out = [o + raw[r * SHARE_BYTES : (r + 1) * SHARE_BYTES] for r, o in enumerate(out)]
    return out
