"""The step path where every worker trains apart (dp.sync=diloco), and what a step returns.

A DiLoCo worker takes dp.inner_steps optimizer steps on its own slice of each global batch with
no communication, then the fragments' syncs start and land (data_parallel.diloco: the outer
step on the averaged pseudo-gradient). The Trainer (data_parallel.worker) takes this path when
it holds an outer optimizer, the synchronous one (DDP, FSDP2) otherwise.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from data_parallel import engine
from data_parallel.checkpoint import Position
from data_parallel.data import Stream, gather_blocks, global_batch, rank_micro_batches
from data_parallel.diloco import DiLoCo

if TYPE_CHECKING:
    from data_parallel.config import DPConfig


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_ms: float
    comm_ms: float
    comm_bytes: int
    wire_bytes: float
    collectives: int
    synced_ms: float = 0.0
    """When the step's synchronising backward returned (DDP: every bucket reduced), ms after
    the step began."""
    trace: list[list[float]] = field(default_factory=list)
    """Its collectives: [launched, completed] ms after the step began, and bytes."""
    worker_loss: float = float("nan")
    """DiLoCo: this worker's own loss on its last inner step (`loss` is the global one, at
    syncs only)."""


@dataclass
class Window:
    """What one worker trained since DiLoCo's last sync."""

    steps: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    """Predicted tokens (block_size - 1 a block), the loss's divisor and the sync's weight."""
    blocks: int = 0
    seconds: float = 0.0
    last_loss: float = float("nan")

    def add(self, loss_sum: float, tokens: int, blocks: int, seconds: float) -> None:
        self.steps += 1
        self.loss_sum += loss_sum
        self.tokens += tokens
        self.blocks += blocks
        self.seconds += seconds
        self.last_loss = loss_sum / tokens

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0


def balanced_inner_steps(seconds_per_step: list[float], inner_steps: int, rank: int) -> int:
    """dp.balance=tokens: `rank`'s inner steps for the next round, so that every worker reaches
    the sync when the fastest has taken `inner_steps`: its share is the fastest worker's step
    time over its own (at least one step)."""
    measured = [s for s in seconds_per_step if s > 0]
    own = seconds_per_step[rank]
    if not measured or own <= 0:
        return inner_steps
    return max(1, min(inner_steps, round(inner_steps * min(measured) / own)))


class TrainsApart:
    """The DiLoCo step path of the Trainer: its state and steps (mixed into the Trainer, which
    sets these attributes and owns the model, the data and the synchronous path)."""

    dp: DPConfig
    world: Any
    timer: engine.CommTimer
    stream: Stream
    position: Position
    data: Any
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    parameters: list[torch.nn.Parameter]
    outer: DiLoCo | None
    window: Window
    inner_steps: int
    fragment_tokens: list[float]
    round_steps: int
    round_blocks: int
    round_step_s: list[float]

    def _token_sum(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError  # the Trainer's

    def _slow_down(self, seconds: float) -> float:
        raise NotImplementedError  # the Trainer's

    def sync_due(self, step: int) -> bool:
        """DiLoCo syncs every dp.inner_steps steps, and at the last."""
        return step % self.dp.inner_steps == 0 or step == self.dp.steps

    def step_apart(self) -> StepResult:
        """One DiLoCo inner step on this worker's own slice of the step's global batch (no
        communication), then whatever syncs fall at this step (data_parallel.diloco)."""
        dp, world, outer = self.dp, self.world, self.outer
        assert outer is not None
        micro = rank_micro_batches(self.stream, self.position.blocks, rank=world.rank,
                                   world_size=world.world_size, batch_size=dp.batch_size,
                                   accum=dp.grad_accum_steps)  # fmt: skip
        local_tokens = dp.batch_size * dp.grad_accum_steps * (dp.block_size - 1)
        self.timer.reset()
        started = time.perf_counter()
        grad_norm = float("nan")
        if self.window.steps < self.inner_steps:  # dp.balance=tokens: its share done, it waits
            local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            for indices in micro:
                ids = gather_blocks(self.data.train, indices).to(self.device)  # (b, T)
                computing = time.perf_counter()
                token_sum = self._token_sum(self.model, ids)
                (token_sum / local_tokens).backward()
                local_sum += token_sum.detach().double()
                self._slow_down(time.perf_counter() - computing)
            grad_norm = engine.clip_gradients(self.parameters, dp.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.window.add(float(local_sum), local_tokens, len(micro) * dp.batch_size,
                            time.perf_counter() - started)  # fmt: skip
            self.fragment_tokens = [t + local_tokens for t in self.fragment_tokens]
        blocks = global_batch(world.world_size, dp.batch_size, dp.grad_accum_steps)
        step = self.position.step + 1
        loss, worker_loss = float("nan"), self.window.last_loss
        tokens = self.position.tokens
        synced = time.perf_counter()
        landed = self._sync(step)
        if landed is not None:
            loss, trained_blocks = landed
            tokens += trained_blocks * dp.block_size
            synced = time.perf_counter()
        step_ms = (time.perf_counter() - started) * 1e3
        self.position = Position(step=step, blocks=self.position.blocks + blocks, tokens=tokens,
                                 wall_s=self.position.wall_s + step_ms / 1e3)  # fmt: skip
        result = StepResult(loss, grad_norm, step_ms, min(self.timer.in_flight_s() * 1e3, step_ms),
                            self.timer.collective_bytes, self.timer.wire_bytes,
                            self.timer.collectives, synced_ms=(synced - started) * 1e3,
                            trace=self.timer.trace(started))  # fmt: skip
        result.worker_loss = worker_loss
        return result

    def _sync(self, step: int) -> tuple[float, int] | None:
        """The syncs at the end of `step`: those due land (the outer step on each one's averaged
        pseudo-gradient, weighted by each worker's tokens), those whose turn it is start (at
        the last step: every sync in flight lands, then every fragment syncs at once). The
        first started carries the window's loss and counts, and (dp.balance=tokens) each
        worker's speed, which sets its inner steps for the next round. Returns (the landed
        windows' mean loss over every worker's tokens, the blocks every worker trained on
        together in them), or None when nothing landed."""
        dp, world, window, outer = self.dp, self.world, self.window, self.outer
        assert outer is not None
        last = step == dp.steps
        landed = outer.land_due(sys.maxsize if last else step)
        starting = list(range(dp.fragments)) if last else outer.due_fragments(step, dp.inner_steps)
        for number, fragment in enumerate(starting):
            extras = torch.zeros(3 + world.world_size, dtype=torch.float64)
            if number == 0:
                extras[:3] = torch.tensor([window.loss_sum, window.tokens, window.blocks])
                extras[3 + world.rank] = window.seconds_per_step
                self.round_steps = window.steps
                self.window = Window()
            due = step if last else step + dp.overlap_steps
            flight = outer.launch(fragment, self.fragment_tokens[fragment], extras, step=step,
                                  due=due)  # fmt: skip
            self.fragment_tokens[fragment] = 0.0
            if due == step:
                landed.append(outer.land(flight))
        if not landed:
            return None
        summed = torch.stack(landed).sum(0)
        loss = float(summed[0] / summed[1]) if summed[1] > 0 else float("nan")
        self.round_blocks = int(summed[2])
        self.round_step_s = summed[3:].tolist()
        if dp.balance == "tokens":
            self.inner_steps = balanced_inner_steps(summed[3:].tolist(), dp.inner_steps,
                                                    world.rank)  # fmt: skip
        return loss, int(summed[2])
