"""How DDP's gradient buckets cross the network (`dp.sync`): torch's own communication hooks,
each timed and counted in bytes like the plain all-reduce.

- `ddp`: a SUM all-reduce of each bucket in fp32 (data_parallel.engine).
- `none`: nothing crosses (the bench's baseline; not data-parallel training).
- `fp16`, `bf16`: torch's `fp16_compress_hook` / `bf16_compress_hook`: the bucket cast down,
  all-reduced, cast back (half the bytes). Whether the installed gloo sums that dtype right is
  checked at start-up on the workers' own group (`check_dtype`), not assumed: bf16 on gloo has
  been broken in some torch releases.
- `topk`: the k largest entries of each bucket's gradients plus what earlier steps did not
  send (error feedback, lab.sparse), as int32 indices and fp32 values. Top-k is an
  all-gather, not an all-reduce (workers keep different entries): each worker receives every
  other's, so its bytes grow with the number of workers.
- `powersgd`: torch's `powerSGD_hook` (Vogels et al. 2019): each large enough gradient matrix
  sent as two rank-r factors, with error feedback and warm start; plain all-reduce before
  `dp.powersgd_start_step`.

torch's hooks average (they divide by the world size); this module's losses are already divided
by the global token count, so its gradients must be summed. Each bucket is multiplied by the
world size before torch's hook divides it again (exact when the world size is a power of two,
within the dtype's rounding otherwise).
"""

# No `from __future__ import annotations`: DDP reads a hook's annotations at registration.
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from data_parallel.config import DPConfig
from lab.cli import ConfigError
from lab.sparse import sparse_with_feedback

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TORCH_HOOKS = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


class TimedTorchHook:
    """The hook state DDP hands back on every bucket: torch's hook and its own state, and the
    step's timer (data_parallel.engine.CommTimer)."""

    def __init__(self, sync: str, timer: Any, state: Any, hook: Callable[..., Any]) -> None:
        self.sync, self.timer, self.state, self.hook = sync, timer, state, hook
        self.world_size = dist.get_world_size()
        self.pending: torch.futures.Future[Any] | None = None
        """PowerSGD: the last bucket's future, which the next bucket waits for."""

    def bucket_bytes(self, bucket: dist.GradBucket) -> tuple[float, float]:
        """(bytes handed to the collectives, bytes one worker sends over a ring)."""
        ring = 2 * (self.world_size - 1) / self.world_size
        numel = bucket.buffer().numel()
        if self.sync in DTYPES:
            sent = 2.0 * numel
            return sent, ring * sent
        state = self.state
        if state.iter < state.start_powerSGD_iter:  # still the plain fp32 all-reduce
            return 4.0 * numel, ring * 4.0 * numel
        rank = state.matrix_approximation_rank
        total = 0.0
        for grad in bucket.gradients():
            rows, cols = grad.shape[0], grad.numel() // max(grad.shape[0], 1)
            compressed = (rows + cols) * rank
            worth = grad.dim() > 1 and compressed * state.min_compression_rate < rows * cols
            total += 4.0 * (compressed if worth else grad.numel())
        return total, ring * total


def timed_torch_hook(
    wrapped: TimedTorchHook, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: torch's, on the bucket scaled to a sum, timed from its launch to
    its completion."""
    bucket.buffer().mul_(wrapped.world_size)  # torch's hook divides by it: the sum remains
    nbytes, wire = wrapped.bucket_bytes(bucket)
    if wrapped.pending is not None:
        # PowerSGD issues its later all-reduces (P, then Q) from the callbacks of the earlier
        # ones, on whichever thread completes them: with two buckets in flight the workers'
        # collectives interleave in different orders, which gloo aborts on ("Received data size
        # doesn't match expected size"; seen at 3 workers with the default model's two
        # buckets). One bucket's collectives at a time keeps every worker's order the same.
        wrapped.pending.wait()
    started = time.perf_counter()
    future = wrapped.hook(wrapped.state, bucket)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        wrapped.timer.record(started, time.perf_counter(), int(nbytes),
                             wire_share=wire / nbytes if nbytes else 0.0)  # fmt: skip
        return fut.value()

    chained = future.then(done)
    if wrapped.sync == "powersgd":
        wrapped.pending = chained
    return chained


class TopK:
    """The top-k hook's state: the fraction kept and, per parameter (by name), what has not
    been sent yet. Top-k is taken per parameter, not per bucket: DDP rebuilds its buckets after
    the first step (and again after a restart), so a per-bucket choice would change with them."""

    def __init__(self, fraction: float, timer: Any, names: dict[int, str]) -> None:
        self.fraction, self.timer, self.names = fraction, timer, names
        self.world_size = dist.get_world_size()
        self.residuals: dict[str, torch.Tensor] = {}
        """parameter name -> its unsent gradient (flat, fp32)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What this worker has not sent yet (its checkpoint's part: each worker's differs)."""
        return {name: value.clone() for name, value in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {name: value.float().clone() for name, value in state.items()}


def compress_bucket(
    buffer: torch.Tensor,
    parts: list[tuple[str, int]],
    residuals: dict[str, torch.Tensor],
    fraction: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each parameter's top-k of its gradient plus its residual, for a bucket laid out as
    `parts` ((name, numel), in order): (indices into the bucket, values). `residuals` is updated
    in place so that the sent values laid out at their indices, plus the new residuals, are the
    gradients plus the old residuals exactly."""
    all_indices, all_values, offset = [], [], 0
    for name, numel in parts:
        grad = buffer[offset : offset + numel]
        previous = residuals.get(name, torch.zeros(numel))
        indices, kept, remaining = sparse_with_feedback(grad.detach(), previous, fraction=fraction)
        residuals[name] = remaining
        all_indices.append(indices + offset)
        all_values.append(kept)
        offset += numel
    return torch.cat(all_indices), torch.cat(all_values)


def topk_hook(state: TopK, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: each parameter's top-k (with error feedback) all-gathered, each
    worker's entries summed into a dense bucket, timed."""
    buffer = bucket.buffer()
    parts = [(state.names.get(id(p), str(id(p))), p.numel()) for p in bucket.parameters()]
    indices, kept = compress_bucket(buffer, parts, state.residuals, state.fraction)
    world = state.world_size
    all_indices = torch.empty(world * indices.numel(), dtype=indices.dtype)
    all_values = torch.empty(world * kept.numel(), dtype=kept.dtype)
    started = time.perf_counter()
    gathered = torch.futures.collect_all([
        dist.all_gather_single(all_indices, indices, async_op=True).get_future(),
        dist.all_gather_single(all_values, kept, async_op=True).get_future(),
    ])  # fmt: skip
    nbytes = indices.numel() * 4 + kept.numel() * 4

    def summed(_: Any) -> torch.Tensor:
        dense = torch.zeros(buffer.numel(), dtype=torch.float32)
        dense.index_add_(0, all_indices.long(), all_values)
        # an all-gather over a ring: each worker sends its own part N-1 times onward
        state.timer.record(started, time.perf_counter(), nbytes, wire_share=world - 1)
        return dense.to(buffer.dtype).view_as(buffer)

    return gathered.then(summed)


def make_hook(dp: DPConfig, timer: Any) -> TimedTorchHook:
    """The state and hook of `dp.sync` (fp16, bf16, powersgd) for DDP.register_comm_hook."""
    if dp.sync == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=dp.powersgd_rank,
            start_powerSGD_iter=dp.powersgd_start_step,
            use_error_feedback=dp.powersgd_error_feedback,
            warm_start=dp.powersgd_warm_start,
        )
        return TimedTorchHook(dp.sync, timer, state, powerSGD_hook.powerSGD_hook)
    check_dtype(dp.sync)
    return TimedTorchHook(dp.sync, timer, None, TORCH_HOOKS[dp.sync])


def check_dtype(sync: str, all_reduce: Callable[[torch.Tensor], object] = dist.all_reduce) -> None:
    """ConfigError (on every worker alike) unless the process group sums `sync`'s dtype right:
    each worker all-reduces known values and compares the sum with fp32's, to the dtype's
    rounding (a collective)."""
    dtype = DTYPES[sync]
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.linspace(0.5, 64.0, 257)
    values = (base * (rank + 1)).to(dtype)
    expected = torch.stack([(base * (r + 1)).to(dtype).float() for r in range(world)]).sum(0)
    all_reduce(values)
    # each addition may round once: world_size half-ulps of the dtype at most
    tolerance = world * torch.finfo(dtype).eps
    error = ((values.float() - expected).abs() / expected.abs()).max().item()
    if not error <= tolerance:
        raise ConfigError(
            f"dp.sync={sync}: this torch's {dist.get_backend()} all-reduce of {dtype} gave a "
            f"wrong sum (relative error {error:.2g}, at most {tolerance:.2g} expected); use "
            "dp.sync=fp16 or dp.sync=ddp"
        )
