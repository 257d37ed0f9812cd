"""DiLoCo (Douillard et al. 2023): workers train apart for `dp.inner_steps` (H) steps, then meet;
streaming DiLoCo (Douillard et al. 2025): the model synced a fragment at a time, the sync
overlapped with the next inner steps.

Every worker holds the whole model and its own inner optimizer (AdamW, or plain SGD), and takes
inner steps on its own data without any communication. Every H steps the workers all-reduce
their pseudo-gradient, the parameters at the last sync minus the parameters now, averaged
weighted by the tokens each trained on, and every worker applies the same outer optimizer step
to the synced parameters: SGD with Nesterov momentum (lr 0.7, momentum 0.9 by default).

So a step's gradients never cross the network; one model's worth of numbers crosses every H
steps. With inner SGD without momentum, H = 1, outer lr 1 and momentum 0 it is DDP with SGD,
step for step (tests/data_parallel/test_diloco.py holds it to 1e-5).

Streaming (`dp.fragments` P > 1, `dp.overlap_steps` tau > 0):
- The parameters are cut into P fragments, contiguous runs of about equal size. Fragment p
  is synced once every H steps, at steps t with t mod H = ((p + 1) H / P) mod H: the syncs are
  staggered, each carries 1/P of the model, so the link's peak load falls by P.
- With tau > 0 a fragment's all-reduce is started at its step and the workers go on training;
  it lands tau steps later, when the outer step is applied to the fragment's synced parameters
  and the result mixed with what the worker trained meanwhile: alpha * own + (1 - alpha) *
  global (`dp.overlap_mix`). The all-reduce overlaps tau steps of compute.
- The global model is the fragments' synced parameters (the same on every worker at any
  time): it is what evaluations see and what a checkpoint holds as the model. Each worker's own
  parameters, and the sums of syncs still in flight, go into its part of the checkpoint.
- At the last step every sync in flight lands and every fragment syncs at once, so the run
  ends on one global model.
With P = 1 and tau = 0 it is DiLoCo as above, step for step.

The pseudo-gradient may cross as fp16 (half the bytes; the all-reduce sums fp16, checked at
start-up as dp.sync=fp16 is) or int8 (each worker's values quantized with one scale, then
all-gathered and summed in fp32: a quarter of fp32's bytes per worker sent, but an all-gather's
bytes grow with the number of workers). Each worker sends its pseudo-gradient scaled by its
tokens over a reference (H steps of the configured batch, times the workers): about 1/N of it,
so fp16 cannot overflow; the sum is rescaled by the reference over the summed tokens when it
lands, which gives the token-weighted average in one round of collectives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lab.sparse import quantize_int8

WIRE_DTYPES = ("fp32", "fp16", "int8")


def cut_fragments(numels: list[int], count: int) -> list[list[int]]:
    """Parameter indices in `count` contiguous runs of about equal total size (a run ends once
    it holds its share of what is left); every run non-empty."""
    if not 1 <= count <= len(numels):
        raise ValueError(f"{count} fragments of {len(numels)} parameters: need 1 <= P <= that")
    runs: list[list[int]] = []
    index = 0
    for fragment in range(count):
        left = count - fragment
        budget = sum(numels[index:]) / left
        run, size = [index], numels[index]
        index += 1
        while len(numels) - index > left - 1 and size + numels[index] / 2 <= budget:
            size += numels[index]
            run.append(index)
            index += 1
        runs.append(run)
    runs[-1].extend(range(index, len(numels)))
    return runs


def fragment_offset(fragment: int, fragments: int, inner_steps: int) -> int:
    """The step (mod H) at which `fragment` is synced: staggered evenly, the last at 0."""
    return ((fragment + 1) * inner_steps // fragments) % inner_steps


@dataclass
class Flight:
    """One fragment's sync, started and not yet applied."""

    fragment: int
    due: int
    """The step at whose end it lands."""
    extras: torch.Tensor
    """fp64 [weight, *extras], summed across workers when it completes."""
    works: list[Any] = field(default_factory=list)
    finish: Callable[[], torch.Tensor] | None = None
    """Waits for the works, returns the summed scaled pseudo-gradient (fp32)."""
    summed: torch.Tensor | None = None
    """The summed scaled pseudo-gradient, once waited for (a checkpoint keeps it)."""
    nbytes: int = 0
    mix: bool = False
    """Mix the synced parameters with this worker's own when it lands (it trained since)."""

    def wait(self) -> torch.Tensor:
        if self.summed is None:
            for work in self.works:
                work.wait()
            assert self.finish is not None
            self.summed = self.finish()
            self.works, self.finish = [], None
        return self.summed


class DiLoCo:
    """The outer loop's state: the parameters at each fragment's last sync (the anchor), the
    outer optimizer, the syncs in flight."""

    def __init__(
        self,
        parameters: list[torch.nn.Parameter],
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        wire: str = "fp32",
        timer: Any = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        mix: float = 0.5,
        reference_tokens: float = 1.0,
    ) -> None:
        if wire not in WIRE_DTYPES:
            raise ValueError(f"wire={wire!r} must be one of {WIRE_DTYPES}")
        self.parameters, self.wire, self.timer = parameters, wire, timer
        # torch refuses Nesterov without momentum: plain SGD then (what H=1 = DDP needs)
        self.outer = torch.optim.SGD(
            parameters, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )
        if momentum > 0:  # a zero buffer steps as a missing one does; a checkpoint needs all
            for param in parameters:
                self.outer.state[param]["momentum_buffer"] = torch.zeros_like(param)
        self.anchor = [p.detach().clone().float() for p in parameters]
        """The parameters at each fragment's last sync (every worker's alike): the global model."""
        self.world_size = dist.get_world_size()
        self.fragments = cut_fragments([p.numel() for p in parameters], fragments)
        self.overlap_steps, self.mix = overlap_steps, mix
        self.reference = reference_tokens * self.world_size
        """What the workers' tokens since a sync sum to when each trained H steps of its batch:
        each sends its pseudo-gradient times its tokens over this."""
        self.in_flight: list[Flight] = []

    @property
    def streaming(self) -> bool:
        """Fragments or overlap: the workers' parameters differ from the global model between
        syncs, and a checkpoint keeps both."""
        return len(self.fragments) > 1 or self.overlap_steps > 0

    def reset_anchor(self) -> None:
        """The parameters now are the synced ones (after a restore from a checkpoint)."""
        for kept, param in zip(self.anchor, self.parameters, strict=True):
            kept.copy_(param.detach())

    def due_fragments(self, step: int, inner_steps: int) -> list[int]:
        """The fragments whose sync starts at the end of `step`."""
        count = len(self.fragments)
        at = step % inner_steps
        return [f for f in range(count) if at == fragment_offset(f, count, inner_steps)]

    def _pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """(numel,) fp32: the fragment's parameters at its last sync minus now, flattened."""
        return torch.cat([
            (self.anchor[i] - self.parameters[i].detach().float()).reshape(-1)
            for i in self.fragments[fragment]
        ])  # fmt: skip

    def launch(
        self, fragment: int, weight: float, extras: torch.Tensor, *, step: int, due: int
    ) -> Flight:
        """Start `fragment`'s sync at the end of `step`: its pseudo-gradient weighted by
        `weight` (this worker's tokens since the fragment's last sync) and a few fp64 `extras`
        (losses, counts), each summed across workers; it lands at the end of step `due`."""
        started = time.perf_counter()
        scaled = self._pseudo_gradient(fragment) * (weight / self.reference)
        head = torch.tensor([weight], dtype=torch.float64)
        flight = Flight(fragment, due, torch.cat([head, extras.double()]),
                        mix=due > step and self.mix > 0)  # fmt: skip
        flight.works.append(dist.all_reduce(flight.extras, async_op=True))
        nbytes = flight.extras.numel() * 8
        if self.wire == "int8":
            values, scale = quantize_int8(scaled)
            world = self.world_size
            every_value = torch.empty(world * values.numel(), dtype=torch.int8)
            every_scale = torch.empty(world, dtype=torch.float32)
            flight.works.append(dist.all_gather_into_tensor(every_value, values, async_op=True))
            flight.works.append(dist.all_gather_into_tensor(every_scale, scale.reshape(1),
                                                            async_op=True))  # fmt: skip

            def gathered() -> torch.Tensor:
                return (every_value.view(world, -1).float() * every_scale.view(world, 1)).sum(0)

            flight.finish = gathered
            nbytes += values.numel() + 4
        else:
            dtype = torch.float16 if self.wire == "fp16" else torch.float32
            buffer = scaled.to(dtype)
            flight.works.append(dist.all_reduce(buffer, async_op=True))
            flight.finish = buffer.float
            nbytes += buffer.numel() * buffer.element_size()
        flight.nbytes = nbytes
        self.in_flight.append(flight)
        if self.timer is not None:
            ring = (self.world_size - 1) / self.world_size
            share = ring * (self.world_size if self.wire == "int8" else 2)
            self.timer.record(started, time.perf_counter(), nbytes, wire_share=share)
        return flight

    def land(self, flight: Flight) -> torch.Tensor:
        """Wait for `flight`, apply the outer step to its fragment's synced parameters, make
        them the new anchor; with overlap, mix them with what this worker trained since.
        Returns the summed extras (without the weight)."""
        started = time.perf_counter()
        summed = flight.wait()
        if self.timer is not None:
            self.timer.blocked(started, time.perf_counter())
        self.in_flight.remove(flight)
        total_weight = float(flight.extras[0])
        average = summed * (self.reference / total_weight) if total_weight > 0 else summed * 0
        self._outer_step(flight.fragment, average, mix=flight.mix)
        return flight.extras[1:]

    def land_due(self, step: int) -> list[torch.Tensor]:
        """Land every sync due at the end of `step` (all of them at the run's last step)."""
        return [self.land(f) for f in list(self.in_flight) if f.due <= step]

    def _outer_step(self, fragment: int, average: torch.Tensor, *, mix: bool) -> None:
        indices = self.fragments[fragment]
        own = [self.parameters[i].detach().clone() for i in indices] if mix else []
        offset = 0
        for i in indices:
            param, kept = self.parameters[i], self.anchor[i]
            count = param.numel()
            with torch.no_grad():
                param.copy_(kept)
            param.grad = average[offset : offset + count].view_as(param).to(param.dtype)
            offset += count
        self.outer.step()  # only this fragment's parameters have gradients: only they move
        self.outer.zero_grad(set_to_none=True)
        for position, i in enumerate(indices):
            param = self.parameters[i]
            self.anchor[i].copy_(param.detach())
            if own:  # alpha * own + (1 - alpha) * global
                with torch.no_grad():
                    param.mul_(1.0 - self.mix).add_(own[position], alpha=self.mix)

    @contextlib.contextmanager
    def global_model(self) -> Iterator[None]:
        """The parameters set to the global model (each fragment's synced values) inside the
        block, this worker's own again after it (nothing to do without streaming: they are
        the same at a sync)."""
        if not self.streaming:
            yield
            return
        own = [p.detach().clone() for p in self.parameters]
        try:
            with torch.no_grad():
                for param, kept in zip(self.parameters, self.anchor, strict=True):
                    param.copy_(kept)
            yield
        finally:
            with torch.no_grad():
                for param, mine in zip(self.parameters, own, strict=True):
                    param.copy_(mine)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This worker's part of a streaming checkpoint (tensors only): its own parameters and
        every sync in flight, waited for (the sums are what landing them later would use)."""
        if not self.streaming:
            return {}
        state = {f"own/{i}": p.detach().clone() for i, p in enumerate(self.parameters)}
        for flight in self.in_flight:
            key = f"flight/{flight.fragment}"
            state[f"{key}/summed"] = flight.wait().clone()
            state[f"{key}/extras"] = flight.extras.clone()
            state[f"{key}/due"] = torch.tensor([flight.due, int(flight.mix)], dtype=torch.int64)
        return state

    def load_state_dict(self, saved: dict[str, torch.Tensor], *, own: bool = True) -> None:
        """After the model (the global one) and the anchor are restored: this worker's own
        parameters (`own`: it is this worker's state, not another's), the syncs in flight."""
        if own:
            for index, param in enumerate(self.parameters):
                value = saved.get(f"own/{index}")
                if value is None or value.shape != param.shape:
                    raise ValueError(f"a checkpoint's DiLoCo state lacks parameter {index}")
                with torch.no_grad():
                    param.copy_(value)
        self.in_flight = []
        for fragment in range(len(self.fragments)):
            key = f"flight/{fragment}"
            if f"{key}/summed" in saved:
                due, mix = saved[f"{key}/due"].tolist()
                self.in_flight.append(Flight(fragment, int(due),
                                             saved[f"{key}/extras"].double().clone(),
                                             summed=saved[f"{key}/summed"].float().clone(),
                                             mix=bool(mix)))  # fmt: skip
