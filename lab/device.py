"""Which device this process computes on, in which dtype, and whether 4-bit bitsandbytes works.

Order of preference: CUDA, then Apple MPS, then CPU. Each module calls `detect_device()` itself,
so one config runs unchanged on a laptop, a gaming PC and a cloud GPU.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def detect_device(prefer: str = "auto") -> torch.device:
    """The best available device: CUDA, then MPS, then CPU (`prefer` forces one, e.g. "cpu")."""
    if prefer != "auto":
        device = torch.device(prefer)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {prefer!r} was asked for but CUDA is not available here")
        if device.type == "mps" and not _mps_available():
            raise ValueError(f"device {prefer!r} was asked for but Apple MPS is not available here")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    elif _mps_available():
        device = torch.device("mps")
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        skip_cudnn_attention()
    return device


def skip_cudnn_attention() -> None:
    """Keep scaled-dot-product attention off cuDNN's kernel in this process (flash or
    memory-efficient attention instead, which torch picks next).

    Measured on an NVIDIA H200 (torch 2.11, cuDNN attention first in torch's order on Hopper):
    `aten::_cudnn_attention_forward` spent 7.9 ms of CPU a call while decoding, every new
    sequence length a new cuDNN graph in each thread, so a 15 M model's decode step took 43-70
    ms instead of 5.4; the split stages, which decode in RPC worker threads, paid it on every
    layer of every token. Idempotent; the other backends are untouched."""
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("CUDA: attention on flash / memory-efficient kernels, not cuDNN's")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def supports_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return device.type == "cpu"  # CPU computes bf16 (slowly on old CPUs); MPS support varies


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype a model runs in on `device` when the config says `auto`.

    bfloat16 on CUDA that has it (fp16 otherwise), float16 on MPS, float32 on CPU, where
    half precision is slower than float32 on most cores.
    """
    if device.type == "cuda":
        return torch.bfloat16 if supports_bf16(device) else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` -> default_dtype(device); otherwise the named dtype."""
    if name == "auto":
        return default_dtype(device)
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {['auto', *_DTYPES]}")
    return _DTYPES[name]


def apply_num_threads(num_threads: int) -> None:
    """Set torch's intra-op threads for this process (0 leaves torch's default)."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def share_of_cores(num_processes: int) -> int:
    """Threads per process when `num_processes` share this machine's cores."""
    return max(1, usable_cores() // num_processes)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the host's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
