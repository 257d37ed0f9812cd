"""`dp.sync=auto`: measure the link and the step, predict each method's time to a loss, pick.

At start-up, before training, every worker takes part in:
- the link: a one-element all-reduce (what the ring's delays cost: 2(N-1) one-way delays) and
  a 1 MiB one (the same delays plus the bytes' time), a few times each, the fastest kept;
- the compute: a training step of this worker's batch without communication, twice (the first
  warms up), on a copy of the model that is then thrown away.

From those, the cost model (data_parallel.manifest's all-reduce on a link) predicts each
method's step and multiplies it by the steps that method needs to reach the loss DDP reaches
(STEPS_TO_LOSS, measured by bench/low_comm_bench.py: DiLoCo and the compressed methods learn
less a step). The fastest is chosen on rank 0 and sent to every worker, and printed in one line
with its reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab.linkmodel import Link

STEPS_TO_LOSS: dict[str, float] = {
    "ddp": 1.0,
    "powersgd": 1.65,
    "topk": 1.8,
    "diloco:25": 1.25,
    "diloco:50": 1.5,
    "diloco:50:5:8": 1.5,
}
"""Steps each method needs, over DDP's, to reach DDP's validation loss at the same tokens a step:
`python bench/low_comm_bench.py` prints them (`steps to DDP's final validation loss / DDP's
steps`) from its 1 Gbit/s runs (the default tiny shape after a 300-step DDP warm start, 3
workers, data_parallel's default batch, 200 DDP steps; evaluated every 10 steps, so each is
known to 0.05). Measured on the 2-core AMD EPYC, 2026-11-25. Another model or budget may need
others; the methods here are the candidates (`diloco:H` is DiLoCo every H steps,
`diloco:H:P:tau` streaming DiLoCo: P fragments, each sync overlapped with tau steps)."""


def settings_of(method: str) -> dict[str, str | int]:
    """The dp.* settings a method name stands for: `ddp`, `diloco:50`, `diloco:50:5:8`."""
    name, *numbers = method.split(":")
    settings: dict[str, str | int] = {"sync": name}
    for key, number in zip(("inner_steps", "fragments", "overlap_steps"), numbers, strict=False):
        settings[key] = int(number)
    return settings


PROBE_BYTES = 1 << 20


@dataclass(frozen=True)
class Measured:
    one_way_s: float
    rate_bps: float
    """Bits per second each worker's link carries (from the large all-reduce)."""
    compute_s: float
    """One training step's compute, without communication."""
    numel: int
    """Trainable parameters (what DDP all-reduces a step, in fp32)."""
    workers: int

    @property
    def link(self) -> Link:
        return Link(one_way_s=self.one_way_s, rate_bps=self.rate_bps)


def measure_link(workers: int, repeats: int = 5) -> tuple[float, float]:
    """(one-way delay s, rate bits/s) from timed all-reduces among the group (a collective)."""

    def fastest(numel: int) -> float:
        buffer = torch.zeros(numel)
        dist.all_reduce(buffer)  # warm-up: the connections and buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(buffer)
            times.append(time.perf_counter() - started)
        return min(times)

    return link_from_times(fastest(1), fastest(PROBE_BYTES // 16), fastest(PROBE_BYTES // 4),
                           workers=workers)  # fmt: skip


def link_from_times(small_s: float, medium_s: float, large_s: float, *, workers: int
                    ) -> tuple[float, float]:  # fmt: skip
    """(one-way delay s, rate bits/s) from the fastest all-reduce of one element, of a quarter
    of PROBE_BYTES and of PROBE_BYTES. One element: 2(N-1) one-way delays (and each call's
    fixed cost, which counts as delay). The rate is what the extra bytes of the large one over
    the medium one took, so delays and fixed costs cancel; where that extra time is lost in
    them (loopback: the bytes take no time a call can see), the large call's own rate, which
    the link carries at least: never a rate no link has (it printed 8,388,608 Mbit/s)."""
    one_way = small_s / (2 * (workers - 1))
    share = 2 * (workers - 1) / workers  # of its bytes each worker sends in a ring all-reduce
    large_bits, medium_bits = 8 * PROBE_BYTES * share, 8 * PROBE_BYTES / 4 * share
    extra_s = large_s - medium_s
    if extra_s > 0.25 * large_s:  # the bytes' own time stands out from the per-call costs
        return one_way, (large_bits - medium_bits) / extra_s
    return one_way, large_bits / max(large_s, 1e-9)


def predict_step_s(method: str, measured: Measured, *, topk_fraction: float = 0.01,
                   powersgd_ratio: float = 0.1) -> float:  # fmt: skip
    """One step of `method` on the measured link: the compute plus what crosses, all-reduces
    at the cost model's price (no overlap with the backward assumed: an upper bound)."""
    from data_parallel.manifest import allreduce_on_link_ms

    n, link, compute = measured.workers, measured.link, measured.compute_s
    full = 4.0 * measured.numel
    if n == 1:
        return compute
    if method == "ddp":
        return compute + allreduce_on_link_ms(full, n, link) / 1e3
    if method == "powersgd":  # two factor all-reduces (P, then Q): two rings' delays
        return compute + 2 * allreduce_on_link_ms(full * powersgd_ratio / 2, n, link) / 1e3
    if method == "topk":  # indices and values all-gathered: N-1 ring steps, each part N-1 times
        sent = 8.0 * topk_fraction * measured.numel * (n - 1)
        return compute + 2 * (n - 1) * 3 * link.one_way_s + link.serialize_s(sent)
    name, *numbers = method.split(":")
    if name == "diloco" and len(numbers) == 1:  # the whole model every H steps
        return compute + allreduce_on_link_ms(full, n, link) / 1e3 / int(numbers[0])
    if name == "diloco" and len(numbers) == 3:  # streaming, diloco:H:P:tau
        h, fragments, overlap = (int(x) for x in numbers)
        # each of the P syncs a round carries 1/P of the model; the workers wait for what
        # tau steps of compute did not cover
        sync = allreduce_on_link_ms(full / fragments, n, link) / 1e3
        return compute + fragments * max(0.0, sync - overlap * compute) / h
    raise ValueError(f"no cost model for {method!r}")


def choose(measured: Measured, *, streaming: bool = True, **options: float) -> tuple[str, str]:
    """(the method, as `settings_of` reads it; the one-line reason): the method with the
    shortest predicted time to DDP's loss (`streaming=False`: not streaming DiLoCo, which
    dp.balance=tokens cannot run)."""
    predicted = {
        method: predict_step_s(method, measured, **options) * factor
        for method, factor in STEPS_TO_LOSS.items()
        if streaming or method.count(":") < 2
    }
    best = min(predicted, key=predicted.__getitem__)
    ranking = ", ".join(f"{m} {1e3 * t:.0f}" for m, t in sorted(predicted.items(),
                                                                 key=lambda kv: kv[1]))  # fmt: skip
    reason = (
        f"dp.sync=auto chose {best}: link {1e3 * measured.one_way_s:.1f} ms one-way, "
        f"{measured.rate_bps / 1e6:.0f} Mbit/s, compute {1e3 * measured.compute_s:.0f} ms a step, "
        f"{measured.numel / 1e6:.2f} M parameters; predicted ms per DDP-step of progress: "
        f"{ranking}"
    )
    return best, reason


def decide(
    workers: int,
    numel: int,
    compute_step: Callable[[], None],
    *,
    streaming: bool = True,
    **options: float,
) -> tuple[str, str]:
    """Measure (a collective: every worker calls it) and choose on rank 0; every worker gets
    rank 0's choice."""
    one_way, rate = measure_link(workers)
    times = []
    for _ in range(2):
        started = time.perf_counter()
        compute_step()
        times.append(time.perf_counter() - started)
    compute = torch.tensor([times[-1]], dtype=torch.float64)
    dist.all_reduce(compute, op=dist.ReduceOp.MAX)  # the slowest worker sets the pace
    measured = Measured(one_way, rate, float(compute), numel, workers)
    box = [choose(measured, streaming=streaming, **options) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]
