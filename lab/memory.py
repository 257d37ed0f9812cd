"""Peak memory of a stretch of work in this process: RSS sampled on CPU, allocator peak on CUDA."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch


@dataclass
class PeakMemory:
    """What `peak_memory()` measured: MiB, filled in when its block ends."""

    rss_mib: float = 0.0
    """Highest resident set size of the process seen during the block (sampled every 5 ms, so a
    spike shorter than that can be missed; the process's whole RSS, runtime included)."""
    cuda_max_allocated_mib: float | None = None
    """CUDA only: the caching allocator's peak during the block (exact)."""


@contextmanager
def peak_memory(*, interval_s: float = 0.005) -> Iterator[PeakMemory]:
    """Measure the peak memory of the `with` block (`ru_maxrss` cannot: it is the process's
    lifetime peak, and the block may come after a bigger one)."""
    result = PeakMemory()
    process = psutil.Process()
    done = threading.Event()
    peak = [process.memory_info().rss]

    def sample() -> None:
        while not done.wait(interval_s):
            peak[0] = max(peak[0], process.memory_info().rss)

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sampler = threading.Thread(target=sample, name="peak-memory", daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        done.set()
        sampler.join()
        peak[0] = max(peak[0], process.memory_info().rss)
        result.rss_mib = peak[0] / 2**20
        if cuda:
            result.cuda_max_allocated_mib = torch.cuda.max_memory_allocated() / 2**20
