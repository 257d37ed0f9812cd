"""The fixed point secure aggregation sums in: values scaled by 2^frac_bits, modulo 2^64
(two's complement), so that masks (uniform uint64s) add and cancel exactly."""

from __future__ import annotations

import math

import numpy as np

FRAC_BITS_MAX = 48


def frac_bits_for(clients: int, weight_cap: float, value_bound: float) -> int:
    """The finest fixed point whose sum over `clients` inputs, each entry at most
    `weight_cap * value_bound` in size (a clipped, weighted update), fits in 63 bits."""
    largest = max(1.0, clients * weight_cap * value_bound)
    return max(0, min(FRAC_BITS_MAX, 62 - math.ceil(math.log2(largest)) - 1))


def quantize(values: np.ndarray, frac_bits: int) -> np.ndarray:
    """Fixed point modulo 2^64 (two's complement): what is summed. Values must be finite."""
    scaled = np.rint(np.asarray(values, dtype=np.float64) * float(2**frac_bits))
    if not np.isfinite(scaled).all() or np.abs(scaled).max(initial=0) >= 2**62:
        raise ValueError("a value does not fit the fixed point (not finite, or too large)")
    return scaled.astype(np.int64).view(np.uint64)


def dequantize(total: np.ndarray, frac_bits: int) -> np.ndarray:
    return total.view(np.int64).astype(np.float64) / float(2**frac_bits)
