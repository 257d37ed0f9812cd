"""DiLoCo (Douillard et al. 2023): workers train apart for `dp.inner_steps` (H) steps, then meet.

Every worker holds the whole model and its own inner optimizer (AdamW, or plain SGD), and takes
inner steps on its own data without any communication. Every H steps the workers all-reduce
their pseudo-gradient, the parameters at the last sync minus the parameters now, averaged
weighted by the tokens each trained on, and every worker applies the same outer optimizer step
to the synced parameters: SGD with Nesterov momentum (lr 0.7, momentum 0.9 by default).

So a step's gradients never cross the network; one model's worth of numbers crosses every H
steps. With inner SGD without momentum, H = 1, outer lr 1 and momentum 0 it is DDP with SGD,
step for step (tests/data_parallel/test_diloco.py holds it to 1e-5).

The pseudo-gradient may cross as fp16 (half the bytes; the all-reduce sums fp16, checked at
start-up as dp.sync=fp16 is) or int8 (each worker's values quantized with one scale, then
all-gathered and summed in fp32: a quarter of fp32's bytes per worker sent, but an all-gather's
bytes grow with the number of workers).

The outer state (the synced parameters are the model's own at a sync, the outer momentum) and
each worker's inner optimizer state go into the checkpoints (data_parallel.checkpoint), which are
written at syncs only: a worker killed between syncs resumes from the last sync with its state.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from lab.sparse import quantize_int8

WIRE_DTYPES = ("fp32", "fp16", "int8")


class DiLoCo:
    """The outer loop's state: the parameters at the last sync, the outer optimizer."""

    def __init__(
        self,
        parameters: list[torch.nn.Parameter],
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        wire: str = "fp32",
        timer: Any = None,
    ) -> None:
        if wire not in WIRE_DTYPES:
            raise ValueError(f"wire={wire!r} must be one of {WIRE_DTYPES}")
        self.parameters, self.wire, self.timer = parameters, wire, timer
        # torch refuses Nesterov without momentum: plain SGD then (what H=1 = DDP needs)
        self.outer = torch.optim.SGD(
            parameters, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
        )
        self.anchor = [p.detach().clone().float() for p in parameters]
        """The parameters at the last sync (every worker's alike)."""
        self.world_size = dist.get_world_size()

    def reset_anchor(self) -> None:
        """The parameters now are the synced ones (after a restore from a checkpoint)."""
        for kept, param in zip(self.anchor, self.parameters, strict=True):
            kept.copy_(param.detach())

    def pseudo_gradient(self) -> torch.Tensor:
        """(numel,) fp32: the parameters at the last sync minus now, flattened."""
        return torch.cat([
            (kept - param.detach().float()).reshape(-1)
            for kept, param in zip(self.anchor, self.parameters, strict=True)
        ])  # fmt: skip

    def sync(self, weight: float, extras: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Average the pseudo-gradients (each worker's weighted by `weight`, its tokens since the
        last sync relative to its share), apply the outer step, make it the new anchor.

        `extras` (a few fp64 numbers: losses, token counts) are summed across workers on the
        way. Returns (the summed extras, bytes this worker handed to the collectives)."""
        delta = self.pseudo_gradient()
        head = torch.tensor([weight], dtype=torch.float64)
        summed_extras = torch.cat([head, extras.double()])
        started = time.perf_counter()
        dist.all_reduce(summed_extras)
        total_weight = float(summed_extras[0])
        nbytes = summed_extras.numel() * 8
        if self.wire == "int8":
            average, sent = self._int8_average(delta * (weight / total_weight))
        else:
            dtype = torch.float16 if self.wire == "fp16" else torch.float32
            buffer = (delta * (weight / total_weight)).to(dtype)
            dist.all_reduce(buffer)
            average, sent = buffer.float(), buffer.numel() * buffer.element_size()
        nbytes += sent
        if self.timer is not None:
            ring = (self.world_size - 1) / self.world_size
            share = ring * (self.world_size if self.wire == "int8" else 2)
            self.timer.record(started, time.perf_counter(), nbytes, wire_share=share)
        self._outer_step(average)
        return summed_extras[1:], nbytes

    def _int8_average(self, scaled: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Each worker's values as int8 with one fp32 scale, all-gathered and summed in fp32."""
        values, scale = quantize_int8(scaled)
        world = self.world_size
        every_value = torch.empty(world * values.numel(), dtype=torch.int8)
        every_scale = torch.empty(world, dtype=torch.float32)
        dist.all_gather_into_tensor(every_value, values)
        dist.all_gather_into_tensor(every_scale, scale.reshape(1))
        parts = every_value.view(world, -1).float() * every_scale.view(world, 1)
        return parts.sum(0), values.numel() + 4

    def _outer_step(self, average: torch.Tensor) -> None:
        offset = 0
        for kept, param in zip(self.anchor, self.parameters, strict=True):
            count = param.numel()
            with torch.no_grad():
                param.copy_(kept)
            param.grad = average[offset : offset + count].view_as(param).to(param.dtype)
            offset += count
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.reset_anchor()

    def wire_bytes_per_sync(self) -> float:
        """What one sync puts on each worker's link (ring algorithms), the pseudo-gradient only."""
        numel = sum(p.numel() for p in self.parameters)
        world = self.world_size
        if self.wire == "int8":
            return (world - 1) * (numel + 4.0)
        size = 2.0 if self.wire == "fp16" else 4.0
        return 2 * (world - 1) / world * numel * size
