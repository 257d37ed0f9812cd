"""The replicas' engines: DDP or FSDP2 around the model, gradients summed across workers, and
the time and bytes of every collective a step waits for.

Gradients are summed, never averaged: each worker's loss is already its tokens' summed loss
divided by the step's global token count, so the sum of the workers' gradients is the gradient
of the global batch's mean loss, exactly as one process computing the whole batch gets it.

- DDP: a communication hook all-reduces each bucket with SUM (DDP's own divides by the world
  size) and times it.
- FSDP2 (`fully_shard`): its reduce-scatter is forced to SUM with no divisor
  (`set_force_sum_reduction_for_comms(True)`, `set_gradient_divide_factor(1.0)`) on every
  sharded module. Left alone it asks for ReduceOp.AVG on fp32, the path torch issue 162338
  found summing instead of averaging on gloo; with SUM and our own division in the loss no
  backend's averaging is involved, and tests/data_parallel's exactness test holds it to one
  process's losses and gradient norms.

Communication, as measured here (simpler than the issue's definition, which subtracts a step
run with a no-op hook): the wall time during which at least one of the step's collectives was in
flight, each timed from its launch to its completion (the union of those intervals). Backward
compute that overlaps an all-reduce counts as communication, so `comm_ms` is an upper bound on
what communication costs a step and `compute_ms = step_ms - comm_ms` a lower bound on compute.
"""

# No `from __future__ import annotations`: DDP reads the hook's annotations at registration and
# wants the objects themselves (dist.GradBucket), not their names.
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)


@dataclass
class CommTimer:
    """Every collective of one step: when it ran, the bytes it was given and those a ring
    algorithm puts on each worker's link (its own sends)."""

    world_size: int
    intervals: list[tuple[float, float]] = field(default_factory=list)
    collective_bytes: int = 0
    """Bytes handed to the collectives (DDP buckets; FSDP's gathered parameters and the
    gradients it reduce-scatters)."""
    wire_bytes: float = 0.0
    """What each worker sends with ring algorithms: 2(N-1)/N of an all-reduce's bytes, (N-1)/N
    of an all-gather's output or a reduce-scatter's input."""
    collectives: int = 0
    bytes_each: list[int] = field(default_factory=list)
    """Each collective's bytes, in the order of `intervals`."""
    ready: float = 0.0
    """When a DDP hook was last handed a bucket (perf_counter; 0: none this step): DDP hands
    them over in order as the backward computes them, so the last is when this worker's own
    gradients were all computed, before it waits for anyone else's."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def blocked(self, started: float, ended: float) -> None:
        """Time this worker waited for a collective it started earlier (DiLoCo's sync landing):
        communication in the step, but no new collective and no bytes."""
        with self._lock:
            self.intervals.append((started, ended))
            self.bytes_each.append(0)

    def bucket_ready(self) -> None:
        """A hook's first call on a bucket (from the backward's thread)."""
        self.ready = time.perf_counter()

    def reset(self) -> None:
        with self._lock:
            self.ready = 0.0
            self.intervals.clear()
            self.bytes_each.clear()
            self.collective_bytes = 0
            self.wire_bytes = 0.0
            self.collectives = 0

    def record(self, started: float, ended: float, nbytes: int, *, wire_share: float) -> None:
        """One collective (called from gloo's threads too)."""
        with self._lock:
            self.intervals.append((started, ended))
            self.bytes_each.append(nbytes)
            self.collective_bytes += nbytes
            self.wire_bytes += wire_share * nbytes
            self.collectives += 1

    @property
    def ring_share(self) -> float:
        """(N-1)/N: the share of a gather's or a scatter's bytes each worker sends."""
        return (self.world_size - 1) / self.world_size

    def trace(self, origin: float) -> list[list[float]]:
        """Each collective as [launched, completed] ms after `origin`, and its bytes, by launch:
        a DDP bucket is launched when its gradients are ready."""
        with self._lock:
            spans = list(zip(self.intervals, self.bytes_each, strict=True))
        rows = [[1e3 * (start - origin), 1e3 * (end - origin), float(nbytes)]
                for (start, end), nbytes in spans]  # fmt: skip
        return sorted(rows)

    def in_flight_s(self) -> float:
        """Seconds during which at least one collective was in flight."""
        with self._lock:
            spans = sorted(self.intervals)
        total, end = 0.0, float("-inf")
        for start, stop in spans:
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        return total

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """A timed, blocking SUM all-reduce of `tensor` (in place)."""
        started = time.perf_counter()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        nbytes = tensor.numel() * tensor.element_size()
        self.record(started, time.perf_counter(), nbytes, wire_share=2 * self.ring_share)
        return tensor


def summed_allreduce_hook(
    timer: CommTimer, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket all-reduced with SUM (no division by the world size;
    the loss carries it), timed from launch to completion."""
    timer.bucket_ready()
    buffer = bucket.buffer()
    started = time.perf_counter()
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    future = work.get_future()
    nbytes = buffer.numel() * buffer.element_size()

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        timer.record(started, time.perf_counter(), nbytes, wire_share=2 * timer.ring_share)
        return fut.value()[0]

    return future.then(done)


def noop_hook(timer: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that communicates nothing: the bucket's local gradients as they
    are (dp.sync=none, the bench's baseline)."""
    timer.bucket_ready()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _timed(timer: CommTimer, work: Any, started: float, nbytes: int) -> Any:
    """Record a collective when it completes (now, or later if it runs asynchronously)."""
    share = timer.ring_share
    if work is None or work.is_completed():
        timer.record(started, time.perf_counter(), nbytes, wire_share=share)
        return work
    work.get_future().add_done_callback(
        lambda _: timer.record(started, time.perf_counter(), nbytes, wire_share=share)
    )
    return work


class TimedAllGather(DefaultAllGather):
    """FSDP2's all-gather of a module's parameters, timed."""

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        started = time.perf_counter()
        work = super().__call__(output_tensor, input_tensor, group, async_op)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        return _timed(self.timer, work, started, nbytes)


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter of a module's gradients, timed."""

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work:
        started = time.perf_counter()
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        return _timed(self.timer, work, started, nbytes)


def layer_classes(model: torch.nn.Module) -> set[str]:
    """The class names of the model's repeated blocks, as Hugging Face declares them for
    sharding (`_no_split_modules`: `LlamaDecoderLayer`); a PEFT wrapper's base model's."""
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def wrap(
    model: torch.nn.Module,
    *,
    engine: str,
    device: torch.device,
    timer: CommTimer,
    dp: Any = None,
    hook: Callable[..., Any] | None = None,
) -> torch.nn.Module:
    """`model` under DDP or FSDP2 (each decoder layer its own unit, then the root), gradients
    summed across workers and every collective timed. Under DDP, `hook(ddp, names=...)`
    registers the communication hook (a dp.sync method's `attach`; None: the plain SUM
    all-reduce) and returns its state, kept for the checkpoints."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        # forward_sync_buffers=False: DDP would otherwise send rank 0's buffers before every
        # forward (two one-way delays a step on gloo); a language model's buffers (rotary
        # frequencies) are computed alike on every worker and never change (they are still
        # synced once, at construction)
        cap = 25.0 if dp is None else dp.bucket_cap_mb
        ddp = DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False,
                                      bucket_cap_mb=cap)  # fmt: skip
        if hook is None:
            ddp.register_comm_hook(timer, summed_allreduce_hook)
        else:
            names = {id(p): name for name, p in model.named_parameters()}
            state = hook(ddp, names=names)
            if state is not None:
                # its state (top-k's residuals, PowerSGD's) goes into the checkpoints
                # (nn.Module.__setattr__ would not keep a plain object)
                object.__setattr__(ddp, "lab_hook_state", state)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    blocks = layer_classes(model)
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
            module.set_custom_all_gather(TimedAllGather(timer))
            module.set_custom_reduce_scatter(TimedReduceScatter(timer))
    return model


@contextlib.contextmanager
def micro_step(model: torch.nn.Module, *, engine: str, sync: bool) -> Iterator[None]:
    """One micro-step's forward and backward; gradients are synchronised only when `sync` (the
    step's last micro-step): the others accumulate locally, without communication."""
    if engine == "ddp":
        if sync or not hasattr(model, "no_sync"):  # no DDP wrapper (DiLoCo): nothing to skip
            yield
            return
        with model.no_sync():  # type: ignore[operator]
            yield
        return
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    yield


def inner(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its DDP wrapper (FSDP2 changes the module in place)."""
    return (
        getattr(model, "module", model)
        if type(model).__name__ == "DistributedDataParallel"
        else model
    )


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """The global gradient norm (over every worker's shard, for FSDP); gradients scaled down
    to `max_norm` when above it (0: never)."""
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(grads, limit)
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2
    return float(full() if callable(full) else norm)
