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
  `dp.powersgd_start_step`. torch keys its state (each worker's error feedback, the warm
  start's Q factors) by bucket index, and DDP's buckets after a restart are not the ones before
  it (its first step runs on the initial buckets, then it rebuilds them): `PowerSGDByParameter`
  keeps that state per parameter, lays it out for whichever bucket torch's hook is given, and
  reads it back when the bucket is done, so it goes into the checkpoint and a restart resumes
  the compression exactly where it stopped.

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
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

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

    def __init__(
        self,
        sync: str,
        timer: Any,
        state: Any,
        hook: Callable[..., Any],
        *,
        by_parameter: "PowerSGDByParameter | None" = None,
    ) -> None:
        self.sync, self.timer, self.state, self.hook = sync, timer, state, hook
        self.world_size = dist.get_world_size()
        self.pending: torch.futures.Future[Any] | None = None
        """PowerSGD: the last bucket's future, which the next bucket waits for."""
        self.by_parameter = by_parameter
        """PowerSGD: its state kept per parameter (checkpointed; None for the other hooks)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this hook (PowerSGD's state; nothing for the others)."""
        return {} if self.by_parameter is None else self.by_parameter.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], *, own: bool = True) -> None:
        if self.by_parameter is not None:
            self.by_parameter.load_state_dict(state, own=own)

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
    wrapped.timer.bucket_ready()
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
    layout = None if wrapped.by_parameter is None else wrapped.by_parameter.lay_out(bucket)
    future = wrapped.hook(wrapped.state, bucket)

    def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        if layout is not None:
            assert wrapped.by_parameter is not None
            wrapped.by_parameter.read_back(bucket.index(), layout)
        wrapped.timer.record(started, time.perf_counter(), int(nbytes),
                             wire_share=wire / nbytes if nbytes else 0.0)  # fmt: skip
        return fut.value()

    chained = future.then(done)
    if wrapped.by_parameter is not None:  # PowerSGD
        wrapped.pending = chained
    return chained


class BucketLayout:
    """Where each parameter's PowerSGD state lies in one bucket's flat tensors, as torch's hook
    lays them out: the error feedback in the bucket's order; the Q factors of the compressed
    matrices grouped by shape (first seen first), each group in the bucket's order."""

    def __init__(self, bucket: dist.GradBucket, names: dict[int, str], state: Any) -> None:
        self.errors: list[tuple[str, int]] = []
        """(name, numel) in the bucket's order."""
        groups: dict[torch.Size, list[tuple[str, int]]] = {}
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            name = names.get(id(param), str(id(param)))
            self.errors.append((name, grad.numel()))
            matrix = grad.view(grad.shape[0], -1)
            rows, cols = matrix.shape
            rank = min(rows, cols, state.matrix_approximation_rank)
            if _should_compress(rows, cols, rank, state.min_compression_rate)[0]:
                groups.setdefault(matrix.shape, []).append((name, cols * rank))
        self.factors = [entry for group in groups.values() for entry in group]
        """(name, numel of its Q factor) in torch's order."""
        self.p_numel = sum(
            shape[0] * min(shape[0], shape[1], state.matrix_approximation_rank) * len(group)
            for shape, group in groups.items()
        )


class PowerSGDByParameter:
    """torch's PowerSGD state, kept per parameter name: each worker's error feedback (what
    compression left out), the warm start's Q factors (the same on every worker), the step
    count and the seed generator torch draws fresh Q factors from."""

    def __init__(self, state: Any, names: dict[int, str]) -> None:
        self.state, self.names = state, names
        self.errors: dict[str, torch.Tensor] = {}
        self.factors: dict[str, torch.Tensor] = {}

    def lay_out(self, bucket: dist.GradBucket) -> BucketLayout | None:
        """Before torch's hook runs on `bucket`: its state for this bucket's parameters, laid
        out as the hook reads it. None while the hook is still a plain all-reduce."""
        state = self.state
        if state.iter < state.start_powerSGD_iter:
            return None
        layout = BucketLayout(bucket, self.names, state)
        index = bucket.index()
        state.error_dict.pop(index, None)
        if state.use_error_feedback and all(name in self.errors for name, _ in layout.errors):
            state.error_dict[index] = torch.cat([self.errors[name] for name, _ in layout.errors])
        state.p_memory_dict.pop(index, None)
        state.q_memory_dict.pop(index, None)
        if state.warm_start and all(name in self.factors for name, _ in layout.factors):
            # torch draws new Q factors where a bucket has none; P is computed before it is read
            dtype, device = bucket.buffer().dtype, bucket.buffer().device
            state.p_memory_dict[index] = torch.empty(layout.p_numel, dtype=dtype, device=device)
            state.q_memory_dict[index] = torch.cat(
                [self.factors[name] for name, _ in layout.factors]
            ).to(device=device, dtype=dtype)
        return layout

    def read_back(self, index: int, layout: BucketLayout) -> None:
        """After torch's hook finished the bucket: its new state, back to each parameter."""
        state = self.state
        if index in state.error_dict:
            parts = torch.split(state.error_dict[index], [n for _, n in layout.errors])
            for (name, _), part in zip(layout.errors, parts, strict=True):
                self.errors[name] = part.detach().clone()
        if index in state.q_memory_dict:
            parts = torch.split(state.q_memory_dict[index], [n for _, n in layout.factors])
            for (name, _), part in zip(layout.factors, parts, strict=True):
                self.factors[name] = part.detach().clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (a checkpoint's `rank-<r>.pt` is read back with weights_only)."""
        kind, keys, position, has_gauss, cached = self.state.rng.get_state()
        assert kind == "MT19937"
        return {
            "iter": torch.tensor(self.state.iter, dtype=torch.int64),
            "rng_keys": torch.from_numpy(keys.astype("int64")),
            "rng_rest": torch.tensor([position, has_gauss, cached], dtype=torch.float64),
            **{f"error/{name}": value.cpu() for name, value in self.errors.items()},
            **{f"factor/{name}": value.cpu() for name, value in self.factors.items()},
        }

    def load_state_dict(self, saved: dict[str, torch.Tensor], *, own: bool = True) -> None:
        """`own=False`: another worker's (this rank is new): everything but its error feedback,
        which starts at zero."""
        import numpy as np

        missing = {"iter", "rng_keys", "rng_rest"} - set(saved)
        if missing:
            raise ConfigError(f"a PowerSGD checkpoint state lacks {sorted(missing)}")
        self.state.iter = int(saved["iter"])
        position, has_gauss, cached = saved["rng_rest"].tolist()
        keys = saved["rng_keys"].numpy().astype(np.uint32)
        self.state.rng.set_state(("MT19937", keys, int(position), int(has_gauss), cached))
        self.factors = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith("factor/")}
        self.errors = {}
        if own:
            self.errors = {
                k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith("error/")
            }


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

    def load_state_dict(self, state: dict[str, torch.Tensor], *, own: bool = True) -> None:
        """`own=False`: another worker's residuals (this rank is new): it starts at zero."""
        self.residuals = {}
        if own:
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
    state.timer.bucket_ready()
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


def powersgd_hook(dp: Any, timer: Any, names: dict[int, str]) -> TimedTorchHook:
    """dp.sync=powersgd's state and hook for DDP.register_comm_hook (`dp`: the DPConfig;
    `names`: each parameter's name by id, as PowerSGD's state is kept by name)."""
    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=dp.powersgd_rank,
        start_powerSGD_iter=dp.powersgd_start_step,
        use_error_feedback=dp.powersgd_error_feedback,
        warm_start=dp.powersgd_warm_start,
    )
    return TimedTorchHook(dp.sync, timer, state, powerSGD_hook.powerSGD_hook,
                          by_parameter=PowerSGDByParameter(state, names))  # fmt: skip


def dtype_hook(sync: str, timer: Any) -> TimedTorchHook:
    """dp.sync=fp16 / bf16: torch's compress hook, once this gloo is seen to sum the dtype."""
    check_dtype(sync)
    return TimedTorchHook(sync, timer, None, TORCH_HOOKS[sync])


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
