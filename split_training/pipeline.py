"""One training step across the stages, run by the stages themselves (on each stage's host).

The driver starts a step with one call per stage (`PipelineStage.train_step`, all at once) and
waits for their answers; everything between travels stage to stage over the lab's signed torch
RPC, each message one way:

- forward: stage k runs a micro-batch and pushes its output to stage k+1 (`receive`); the last
  stage turns it into the micro-batch's summed token loss;
- backward: each stage runs its own part of the backward with torch's local autograd (the
  received activation is a leaf; its `.grad` is what goes back) and pushes that gradient to
  stage k-1;
- the step: every stage sends every other its squared gradient norm once its backward is done
  (the first stage, which finishes last, with the tied matrix counted once); each then clips
  with the same global norm and steps its own AdamW. A tied embedding / LM head: the last stage
  sends its head's gradient to the first as soon as its own backward is done (overlapped with
  the rest of the backward), the first sends its own back with its norm, and both ends add
  them first + last, so both take the identical update.

At 2 stages a step waits for 5 one-way delays (driver -> stages, forward, backward, the norm,
the answers), 2p + 1 at p stages, whatever the micro-batch count. `schedule` orders each stage's
work: `gpipe` runs every forward, then every backward; `1f1b` keeps at most p - k micro-batches
of stage k in flight (one forward, one backward in the steady state), so a stage holds the
activations of fewer micro-batches at a time. Both accumulate each stage's gradients in
micro-batch order, so the two schedules, and any link, give the same numbers.

Why not torch's distributed autograd (which split training used until this module): its engine
answers a second gradient message for a context whose backward is already running at once,
before that part of the backward has run (`DistEngine::executeSendFunctionAsync`), so the
driver's `dist_autograd.backward` could return while a stage was still adding micro-batch
gradients, and the norm, clip and step read them early (see docs/split.md).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.rpc import RRef

from split_engine import rpc_guard
from split_engine.handshake import require_driver
from split_engine.liveness import PING_TIMEOUT_S, WATCH_S, PeerGoneError, PeerWatch
from split_engine.rpc_guard import never_sent
from split_engine.stage import Stage
from split_engine.workers import DRIVER, stage_name
from split_training.config import SCHEDULES

ACTIVATION, GRADIENT, NORM, TIED, ABORT = "activation", "gradient", "norm", "tied", "abort"
KINDS = (ACTIVATION, GRADIENT, NORM, TIED, ABORT)
MAX_MICROBATCHES = 512
"""Micro-batches of all batches of one step, at most (each holds slots in a stage's inbox)."""
MAX_TOKENS = 1 << 22
"""Token positions of one micro-batch, at most (what a peer's activation may claim)."""


class StageAdamW(torch.optim.AdamW):
    """AdamW as each stage's local optimizer (a class of its own so that no peer can ever be
    sent one: `never_sent`)."""


never_sent(StageAdamW)


def schedule_order(schedule: str, stage: int, num_stages: int, microbatches: int) -> list[str]:
    """The order stage `stage` (0-based) runs its micro-batches' forwards (`F3`) and backwards
    (`B3`) in: GPipe every forward first; 1F1B `num_stages - stage - 1` forwards of warm-up,
    then one forward and one backward at a time, then the remaining backwards."""
    if schedule not in SCHEDULES:
        raise ValueError(f"split.schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
    m = microbatches
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    warmup = min(num_stages - stage - 1, m)
    order = [f"F{i}" for i in range(warmup)]
    for i in range(m - warmup):
        order += [f"F{warmup + i}", f"B{i}"]
    order += [f"B{i}" for i in range(m - warmup, m)]
    return order


class Inbox:
    """What peers have pushed to this stage for the step under way (or the next one: a peer's
    message may come before the driver's call that starts it), taken once each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: dict[tuple, Any] = {}
        self.cond = threading.Condition()
        self.done = -1
        """The last step this stage finished; only the two after it are accepted."""
        self.aborted: dict[int, str] = {}
        """Steps a peer gave up, with its reason: a wait for them ends at once."""

    def put(self, key: tuple, value: Any) -> None:
        with self.cond:
            step = key[1]
            if not self.done < step <= self.done + 2:
                raise ValueError(f"a message for step {step}, this stage is past {self.done}")
            if key[0] == ABORT:
                self.aborted[step] = value
                self.cond.notify_all()
                return
            if key in self.items:
                raise ValueError(f"a second message {key[0]} for the same slot {key[1:]}")
            if len(self.items) >= self.limit:
                raise ValueError(f"more than {self.limit} messages waiting")
            self.items[key] = value
            self.cond.notify_all()

    def take(
        self, key: tuple, timeout_s: float, *, check: Callable[[], None] = lambda: None
    ) -> Any:
        """The message at `key`, waiting up to `timeout_s`; `check` (which raises for a peer
        that is gone) runs every WATCH_S meanwhile, outside the lock."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.cond:
                if key in self.items:
                    return self.items.pop(key)
                if key[1] in self.aborted:
                    raise ValueError(self.aborted[key[1]])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(
                        f"no {key[0]} for step {key[1]} {key[2:]} within {timeout_s:g} s "
                        "(split.rpc_timeout_s, times the micro-batches a wait may span): a "
                        "peer stage is gone or stuck"
                    )
                self.cond.wait(min(left, WATCH_S))
                if key in self.items:
                    return self.items.pop(key)
            check()

    def finish(self, step: int) -> None:
        """Step `step` is over: what is left of it is dropped."""
        with self.cond:
            self.done = max(self.done, step)
            self.items = {k: v for k, v in self.items.items() if k[1] > step}
            self.aborted = {k: v for k, v in self.aborted.items() if k > step}


@dataclass
class Plan:
    """What every stage is told of a step: its shape, which it checks every message against."""

    step: int
    batches: int
    microbatches: int
    rows: int
    """Rows of one micro-batch."""
    tokens: int
    apply: bool
    """Clip and step (False: only return the gradients, for tests and tools)."""

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> Plan:
        plan = cls(**fields)
        for name in ("step", "batches", "microbatches", "rows", "tokens"):
            value = getattr(plan, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"plan.{name}={value!r} must be a non-negative int")
        if min(plan.batches, plan.microbatches, plan.rows) < 1 or plan.tokens < 2:
            raise ValueError(f"an empty step: {fields}")
        if not isinstance(plan.apply, bool):
            raise ValueError(f"plan.apply={plan.apply!r} must be a bool")
        if plan.batches * plan.microbatches > MAX_MICROBATCHES or plan.rows * plan.tokens > (
            MAX_TOKENS
        ):
            raise ValueError(f"a step larger than this stage takes: {fields}")
        return plan


class SavedBytes:
    """Bytes of the tensors autograd keeps for the backward (`saved_tensors_hooks`), per
    micro-batch, each storage counted once and the model's own weights not at all: the
    activation memory a schedule holds, whatever the allocator does."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weights = {t.untyped_storage().data_ptr() for t in model.parameters()}
        self.weights |= {t.untyped_storage().data_ptr() for t in model.buffers()}
        self.live = 0
        self.peak = 0

    @contextmanager
    def counting(self) -> Iterator[dict[int, int]]:
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if key not in self.weights and key not in seen:
                    seen[key] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield seen
        self.live += sum(seen.values())
        self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class PipelineStage:
    """A stage's part of training, on the stage's own host (created there by the driver)."""

    def __init__(
        self,
        stage: RRef,
        index: int,
        num_stages: int,
        settings: dict[str, Any],
        timeout_s: float,
    ) -> None:
        self.stage: Stage = stage.local_value()
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.schedule = str(settings["schedule"])
        schedule_order(self.schedule, index, num_stages, 1)  # a bad name fails here
        self.grad_clip = float(settings["grad_clip"])
        self.sync_tied = bool(settings.get("sync_tied", True))
        self.timeout_s = timeout_s
        self.params = [p for p in self.stage.model.parameters() if p.requires_grad]
        self.optimizer = (
            StageAdamW(self.params, lr=settings["lr"], weight_decay=settings["weight_decay"])
            if self.params
            else None
        )
        self.peers: list[RRef] = []
        self.inbox = Inbox(limit=4 * MAX_MICROBATCHES + 4 * num_stages)
        self.saved = SavedBytes(self.stage.model)
        self.stepping = threading.Lock()
        """One step at a time: a second `train_step` while one runs is refused."""
        others = [stage_name(k + 1) for k in range(num_stages) if k != index]
        heartbeat = float(settings.get("heartbeat_timeout_s", PING_TIMEOUT_S))
        self.watch = PeerWatch([DRIVER, *others], ping_timeout_s=min(timeout_s, heartbeat))
        """Heartbeats to the driver and the other stages while a step waits on a message."""

    def connect(self, peers: list[RRef]) -> int:
        """Every stage's `PipelineStage` RRef, in stage order; returns the count this trains."""
        require_driver()
        if self.peers:
            raise ValueError("this stage's peers are set already")
        if len(peers) != self.num_stages:
            raise ValueError(f"{len(peers)} peers for {self.num_stages} stages")
        self.peers = peers
        return sum(p.numel() for p in self.params)

    # ------------------------------------------------------------------ from peers

    def receive(self, kind: str, step: int, slot: tuple[int, int], value: Any) -> None:
        """A peer's push: an activation or a gradient of micro-batch `slot` (batch, index), a
        squared norm, or a tied gradient. Checked here for what it is; checked against the
        step's plan when the step takes it."""
        if kind not in KINDS:
            raise ValueError(f"unknown message kind {kind!r}")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"step {step!r} is not an int")
        if (
            not isinstance(slot, tuple)
            or len(slot) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in slot)
        ):
            raise ValueError(f"slot {slot!r} is not two non-negative ints")
        if kind in (NORM, TIED, ABORT) and (slot[0] != 0 or slot[1] >= self.num_stages):
            raise ValueError(f"a {kind} for slot {slot}: there are {self.num_stages} stages")
        if kind == ABORT:
            if not isinstance(value, str) or len(value) > 500 or not value.isprintable():
                raise ValueError("an abort's reason must be one printable line of <= 500 chars")
        elif kind == NORM:
            if not isinstance(value, float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"a squared norm must be a finite float >= 0, got {value!r}")
        elif not isinstance(value, torch.Tensor) or value.is_sparse or value.is_quantized:
            raise ValueError(f"a {kind} must be a dense tensor, got {type(value).__name__}")
        elif kind == TIED:
            ends = self.stage._tied_ends()
            if not ends or tuple(value.shape) != tuple(ends[0].shape):
                raise ValueError(f"a tied gradient of shape {tuple(value.shape)} here")
        elif (
            value.dim() != 3
            or value.dtype != self.stage.wire_dtype
            or value.shape[-1] != self.stage.hidden_size
            or value.shape[0] * value.shape[1] > MAX_TOKENS
        ):
            raise ValueError(
                f"a {kind} of {tuple(value.shape)} {value.dtype}: this cut carries "
                f"(rows, tokens, {self.stage.hidden_size}) {self.stage.wire_dtype}"
            )
        self.inbox.put((kind, step, *slot), value)

    def _take(
        self, kind: str, step: int, slot: tuple[int, int], like: Any = None, *, waits: int = 1
    ) -> Any:
        """The message for `slot`, waiting up to `waits` x split.rpc_timeout_s (a stage may
        wait for a whole pipeline fill before its first gradient)."""
        value = self.inbox.take((kind, step, *slot), self.timeout_s * waits, check=self._peers)
        if like is not None and (value.shape != like.shape or value.dtype != like.dtype):
            raise ValueError(
                f"{kind} for micro-batch {slot} of shape {tuple(value.shape)} {value.dtype}, "
                f"expected {tuple(like.shape)} {like.dtype}"
            )
        if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{kind} for micro-batch {slot} holds inf or nan")
        return value

    def _peers(self) -> None:
        """The watch's check, its error a ValueError (what a step's refusal travels as)."""
        try:
            self.watch.check()
        except PeerGoneError as exc:
            raise ValueError(str(exc)) from None

    # ------------------------------------------------------------------ one step

    def train_step(
        self, plan_fields: dict[str, Any], tokens: torch.Tensor | None, scales: list[float]
    ) -> dict[str, Any]:
        """This stage's part of one step (see the module). `tokens` (batches, rows x
        microbatches, tokens) goes to the first stage (its input) and the last (its labels).
        Returns the summed losses per batch (the last stage), the global gradient norm, the
        peak saved-tensor bytes and, without `plan.apply`, this stage's gradients."""
        require_driver()
        if not self.stepping.acquire(blocking=False):
            raise ValueError(f"stage {self.index + 1} is in a step already")
        try:
            return self._step(plan_fields, tokens, scales)
        finally:
            self.stepping.release()

    def _step(
        self, plan_fields: dict[str, Any], tokens: torch.Tensor | None, scales: list[float]
    ) -> dict[str, Any]:
        plan = Plan.from_dict(plan_fields)
        pending: list[torch.futures.Future] = []
        started = time.perf_counter()
        try:
            if plan.step != self.inbox.done + 1:
                raise ValueError(f"step {plan.step} after step {self.inbox.done}")
            if (self.first or self.last) and (
                tokens is None
                or tokens.dtype != torch.long
                or tuple(tokens.shape) != (plan.batches, plan.rows * plan.microbatches, plan.tokens)
                or int(tokens.min()) < 0
                or int(tokens.max()) >= self.stage.vocab_size
            ):
                raise ValueError(f"this stage needs the step's token ids, shaped as {plan}")
            if len(scales) != plan.batches or not all(
                isinstance(s, float) and math.isfinite(s) for s in scales
            ):
                raise ValueError(f"one finite loss scale per batch, got {scales!r}")
            self.saved.live = self.saved.peak = 0
            losses = [
                self._run_batch(plan, batch, tokens, scales[batch], pending)
                for batch in range(plan.batches)
            ]
            norm, grads = self._finish(plan, pending)
            for future in pending:  # every push this step made has been served
                future.wait()
        except Exception as exc:
            self._abort(plan.step, exc)
            raise
        finally:
            if plan.step > self.inbox.done:  # a late or repeated step leaves the inbox alone
                self.inbox.finish(plan.step)
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
        return {
            "losses": losses,
            "grad_norm": norm,
            "saved_peak_bytes": self.saved.peak,
            "seconds": time.perf_counter() - started,
            "gradients": grads,
        }

    def _abort(self, step: int, exc: Exception) -> None:
        """Tell every peer this stage gave up on `step` (and why), so that none waits a timeout
        for a message that will not come; their steps fail naming this stage's reason."""
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if reason.startswith("stage "):  # a peer's abort: it has told everyone already
            return
        reason = f"stage {self.index + 1} gave up: {reason}"[:500]
        for peer in range(self.num_stages):
            if peer != self.index:
                with contextlib.suppress(Exception):  # a peer that is gone needs no telling
                    self.peers[peer].rpc_async(timeout=self.timeout_s).receive(
                        ABORT, step, (0, self.index), reason
                    )

    def _push(self, pending: list, to: int, kind: str, step: int, slot: tuple, value: Any) -> None:
        pending.append(
            self.peers[to].rpc_async(timeout=self.timeout_s).receive(kind, step, slot, value)
        )

    def _run_batch(
        self,
        plan: Plan,
        batch: int,
        tokens: torch.Tensor | None,
        scale: float,
        pending: list,
    ) -> float:
        """The forwards and backwards of one batch's micro-batches, in the schedule's order;
        returns the batch's summed token loss (last stage), else 0."""
        rows, length = plan.rows, plan.tokens
        positions = torch.arange(length).expand(rows, length)  # (rows, T)
        micro = None if tokens is None else tokens[batch].split(rows)  # (rows, T) each
        kept: dict[int, tuple[torch.Tensor | None, torch.Tensor, int]] = {}
        total = 0.0
        wire = torch.empty(rows, length, self.stage.hidden_size, dtype=self.stage.wire_dtype)
        fill = plan.microbatches + self.num_stages  # a wait may span a pipeline's fill
        for action in schedule_order(self.schedule, self.index, self.num_stages, plan.microbatches):
            i = int(action[1:])
            slot = (batch, i)
            if action[0] == "F":
                if self.first:
                    x: torch.Tensor = micro[i]  # type: ignore[index]
                    leaf = None
                else:
                    x = self._take(ACTIVATION, plan.step, slot, like=wire, waits=fill)
                    leaf = x = x.requires_grad_()
                labels = micro[i] if self.last else None  # type: ignore[index]
                with self.saved.counting() as seen:
                    out = self.stage.train_forward(x, positions, labels)
                if self.last:
                    total += float(out.detach())
                    out = out * scale
                else:
                    self._push(pending, self.index + 1, ACTIVATION, plan.step, slot, out.detach())
                kept[i] = (leaf, out, sum(seen.values()))
            else:
                leaf, out, nbytes = kept.pop(i)
                if self.last:
                    out.backward()
                else:
                    grad = self._take(GRADIENT, plan.step, slot, like=out, waits=fill)
                    torch.autograd.backward(out, grad)
                self.saved.release(nbytes)
                if leaf is not None:
                    assert leaf.grad is not None
                    self._push(pending, self.index - 1, GRADIENT, plan.step, slot, leaf.grad)
                if self.last and i == plan.microbatches - 1 and batch == plan.batches - 1:
                    self._send_tied_early(plan, pending)
        return total

    def _tied_grad(self) -> torch.Tensor | None:
        ends = self.stage._tied_ends()
        if not ends or ends[0].grad is None or self.num_stages == 1 or not self.sync_tied:
            return None
        return ends[0].grad

    def _send_tied_early(self, plan: Plan, pending: list) -> None:
        """The last stage's head gradient is whole once its own backward is done: off to the
        first stage now, while the backward goes on upstream."""
        grad = self._tied_grad()
        if grad is not None:
            # a copy: TensorPipe sends a CPU tensor's memory as it is when it goes out, after
            # this call returns, and this gradient is added to and clipped in place meanwhile
            self._push(pending, 0, TIED, plan.step, (0, 0), grad.detach().cpu().clone())

    def _finish(self, plan: Plan, pending: list) -> tuple[float, dict[str, torch.Tensor] | None]:
        """Tie the two ends' gradients, agree on the global norm, clip and step."""
        tied = self._tied_grad()
        if tied is not None and self.first:  # first + last, the same sum on both ends
            theirs = self._take(TIED, plan.step, (0, 0), like=tied.cpu())
            tied.add_(theirs.to(tied.device, tied.dtype))
        copy = self.stage._tied_copy()
        own = 0.0
        for param in self.params:
            if param.grad is not None and param is not copy:
                own += float(param.grad.detach().float().pow(2).sum())
        if not math.isfinite(own):
            raise ValueError(f"stage {self.index + 1}'s gradients hold inf or nan")
        for peer in range(self.num_stages):
            if peer != self.index:
                self._push(pending, peer, NORM, plan.step, (0, self.index), own)
                if tied is not None and self.first and peer == self.num_stages - 1:
                    self._push(pending, peer, TIED, plan.step, (0, 1), tied.detach().cpu().clone())
        if tied is not None and self.last:
            first = self._take(TIED, plan.step, (0, 1), like=tied.cpu())
            tied.copy_(first.to(tied.device, tied.dtype))  # the first stage's first + last
        squares = [
            own if peer == self.index else self._take(NORM, plan.step, (0, peer))
            for peer in range(self.num_stages)
        ]
        norm = math.sqrt(sum(squares))  # in stage order: the same float on every stage
        if not math.isfinite(norm):
            raise ValueError(f"the global gradient norm is {norm}: not stepping")
        if not plan.apply:
            return norm, {
                name: p.grad.detach().cpu()
                for name, p in self.stage.model.named_parameters()
                if p.grad is not None
            }
        if self.grad_clip > 0 and norm > self.grad_clip:
            factor = self.grad_clip / (norm + 1e-6)
            for param in self.params:
                if param.grad is not None:
                    param.grad.mul_(factor)
        for future in pending:  # every peer took this step's pushes before this stage steps
            future.wait()
        if self.optimizer is not None:
            self.optimizer.step()
        return norm, None

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: str) -> list[str]:
        """This stage's trainable weights (safetensors) and optimizer state, atomically."""
        from pathlib import Path

        from safetensors.torch import save_file

        from lab import atomic

        require_driver()
        target = Path(folder)
        target.mkdir(parents=True, exist_ok=True)
        weights, optim = _stage_files(target)
        stage = self.stage
        metadata = {"start": str(stage.start), "end": str(stage.end)}
        atomic.replace_file(
            weights, lambda tmp: save_file(stage.trainable_state(), str(tmp), metadata=metadata)
        )
        if self.optimizer is None:
            raise ValueError(f"stage {self.index} trains nothing, so it has no optimizer")
        optimizer = self.optimizer
        atomic.replace_file(optim, lambda tmp: torch.save(optimizer.state_dict(), tmp))
        return [weights.name, optim.name]

    def load(self, folder: str) -> None:
        from pathlib import Path

        from safetensors.torch import load_file

        require_driver()
        weights, optim = _stage_files(Path(folder))
        self.stage.load_trainable_state(load_file(str(weights)))
        if self.optimizer is None:
            raise ValueError(f"stage {self.index} trains nothing, so it has no optimizer")
        self.optimizer.load_state_dict(torch.load(optim, weights_only=True))


def _stage_files(folder: Any) -> tuple[Any, Any]:
    import torch.distributed.rpc as rpc

    name = rpc.get_worker_info().name
    return folder / f"{name}.safetensors", folder / f"{name}.optim.pt"


never_sent(PipelineStage)  # a peer may call its methods, never fetch it (it holds the weights)

# What split training's RPCs name beyond the engine's; allowed in its processes only.
rpc_guard.allow(__name__, "PipelineStage")
