"""What a split run's stages measure of their memory: their own peak (the run's summary) and
what the driver may still place on them (`free_memory_bytes`, called over RPC, after the
handshake only).
"""

from __future__ import annotations

import time

import torch

from split_engine.handshake import require_driver


def peak_memory() -> dict[str, float]:
    """This process's peak and current resident memory (and CUDA peak where CUDA is used)."""
    import resource

    import psutil

    stats = {
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_mib": psutil.Process().memory_info().rss / 2**20,
        "cpu_s": time.process_time(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return stats


def free_memory_bytes() -> float:
    """Memory a stage could still fill: free CUDA memory on a GPU host, available RAM otherwise."""
    require_driver()
    from lab.device import detect_device

    device = detect_device()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    import psutil

    return float(psutil.virtual_memory().available)
