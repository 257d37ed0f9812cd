"""Several generation requests in flight through the split pipeline (continuous batching).

The driver's `Pipeline` keeps up to `max_concurrent` requests, each with its own KV-cache slot
on every stage, and up to `in_flight` micro-batches moving down the stages at once: while stage
2 computes one micro-batch's token, stage 1 computes the next one's. A micro-batch is the set of
requests whose next token is ready to be computed when a place in the pipeline frees; requests
join (their prompt goes through alone, the prefill) and leave (end of text, max tokens, a client
gone) between tokens.

How it stays deadlock-free: the driver relays each micro-batch from stage to stage itself (one
`Stage.step` call per stage, none chained), so a stage never calls out and none of TensorPipe's
worker threads waits on a future; the callbacks that TensorPipe runs when a call ends only put
the result on the scheduler's queue. The scheduler is a thread of the driver's own. In-flight
calls per stage are at most `in_flight` steps, plus the slot releases of requests that ended.

The scheduler only steps the pipeline and hands out token ids: each request's ids go onto its
own queue, and its caller's thread (`generate`) takes them from there and runs `on_token`
(detokenizing, server-sent events, a client's stop string), so N clients' serving work runs
beside the stepping instead of in turn with it. A caller whose `on_token` raises sends the
scheduler a cancel: the request ends between tokens, or when the step it is in comes back.

On a stage (`step`): the requests' caches are left-padded to the longest, stacked into one batch
for the layers, and cut back into each request's own slot afterwards; a micro-batch of one
request uses its cache as it is (the same computation as a request served alone).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from split_engine.generation import Sampling, TokenPicker

log = logging.getLogger(__name__)

WAIT_S = 5.0
"""How often the scheduler, idle or waiting for a stage, looks again (and at `closing`)."""
MAX_SLOTS = 1024
"""Requests one stage holds a KV-cache slot for at once (the driver bounds its own with
split.max_concurrent; this bounds what any signed caller can make a stage hold)."""


# ---------------------------------------------------------------------- on a stage


def _stacked(caches: list[Any], lengths: list[int]) -> tuple[Any, int]:
    """One cache for a micro-batch: each request's keys and values (1, heads, len, dim) left-
    padded with zeros to the longest, stacked (k, heads, L, dim). Returns it and L."""
    from transformers import DynamicCache

    longest = max(lengths)
    stacked = DynamicCache()
    if longest == 0:
        return stacked, 0
    template = next(c for c, n in zip(caches, lengths, strict=True) if n)
    for index in range(len(template.layers)):
        keys, values = [], []
        for cache, length in zip(caches, lengths, strict=True):
            if length:
                k, v = cache.layers[index].keys, cache.layers[index].values  # (1, h, len, d)
            else:
                shape = template.layers[index].keys.shape
                k = v = template.layers[index].keys.new_zeros((1, shape[1], 0, shape[3]))
            keys.append(F.pad(k, (0, 0, longest - length, 0)))  # (1, h, L, d)
            values.append(F.pad(v, (0, 0, longest - length, 0)))
        stacked.update(torch.cat(keys), torch.cat(values), index)  # (k, h, L, d)
    return stacked, longest


def _unstacked(stacked: Any, row: int, *, drop: int) -> Any:
    """Row `row` of a stacked cache, its first `drop` (padding) positions cut off."""
    from transformers import DynamicCache

    own = DynamicCache()
    for index, layer in enumerate(stacked.layers):
        keys = layer.keys[row : row + 1, :, drop:].contiguous()  # (1, h, len, d)
        values = layer.values[row : row + 1, :, drop:].contiguous()
        own.update(keys, values, index)
    return own


def stage_step(
    stage: Any, x: torch.Tensor, requests: list[int], opening: list[dict[str, Any] | None]
) -> torch.Tensor:
    """`Stage.step`: one micro-batch of requests through this stage's layers.

    `x` is (k, T) token ids on the first stage, (k, T, H) hidden states on the others; row i
    belongs to `requests[i]`, whose slot is opened here when `opening[i]` holds its sampling
    (its prefill). Positions follow each request's cache. Returns hidden states (k, T, H) in
    the wire dtype, or on the last stage each request's next token (k,), picked by its picker.
    """
    from transformers import DynamicCache

    if (
        not isinstance(x, torch.Tensor)
        or x.shape[0] != len(requests)
        or len(opening) != len(requests)
    ):
        raise ValueError(f"a step of {len(requests)} requests needs {len(requests)} rows")
    if len(set(requests)) != len(requests):
        raise ValueError(f"a step names a request twice: {requests}")
    if stage.first:  # token ids: an id past the vocabulary is a device-side assert on a GPU
        if x.dim() != 2 or x.dtype != torch.long or x.numel() == 0:
            raise ValueError(
                f"the first stage takes (k, T) int64 token ids, not {x.dtype} {tuple(x.shape)}"
            )
        if int(x.min()) < 0 or int(x.max()) >= stage.vocab_size:
            raise ValueError(f"token ids outside 0..{stage.vocab_size - 1}")
    elif x.dim() != 3 or x.shape[2] != stage.hidden_size or not x.is_floating_point():
        raise ValueError(
            f"a stage takes (k, T, {stage.hidden_size}) hidden states, not {tuple(x.shape)}"
        )
    rows, tokens = x.shape[0], x.shape[1]
    stage.bytes_received += x.numel() * x.element_size()
    with stage.lock, torch.no_grad(), stage._autocast():
        started = time.perf_counter()
        for request, sampling in zip(requests, opening, strict=True):  # all checked first:
            if sampling is not None and request in stage.caches:  # a refused step opens none
                raise ValueError(f"request {request} already has a slot on this stage")
            if sampling is None and request not in stage.caches:
                raise ValueError(f"request {request} has no slot on this stage")
        opened = sum(s is not None for s in opening)
        if len(stage.caches) + opened > MAX_SLOTS:
            raise ValueError(f"a stage holds at most {MAX_SLOTS} requests' slots")
        pairs = [(r, s) for r, s in zip(requests, opening, strict=True) if s is not None]
        pickers = {r: TokenPicker(Sampling.from_dict(s)) for r, s in pairs} if stage.last else {}
        for request, _ in pairs:  # (a bad sampling dict has raised above: nothing opened)
            stage.caches[request] = DynamicCache()
        stage.pickers.update(pickers)
        own = [stage.caches[r] for r in requests]
        lengths = [c.get_seq_length() for c in own]
        if rows == 1:
            cache, longest = own[0], lengths[0]
        else:
            cache, longest = _stacked(own, lengths)
        mask = torch.ones((rows, longest + tokens), dtype=torch.long)  # (k, L + T)
        for row, length in enumerate(lengths):
            mask[row, : longest - length] = 0
        positions = torch.tensor(lengths)[:, None] + torch.arange(tokens)  # (k, T)
        inputs: dict[str, Any] = {
            "attention_mask": mask.to(stage.device),
            "position_ids": positions.to(stage.device),
            "use_cache": True,
            "past_key_values": cache,
        }
        if stage.first:
            inputs["input_ids"] = x.to(stage.device)
        else:
            inputs["inputs_embeds"] = x.to(stage.device, stage.dtype)  # (k, T, H)
        out = stage.decoder(**inputs)
        if rows == 1:
            stage.caches[requests[0]] = out.past_key_values
        else:
            for row, (request, length) in enumerate(zip(requests, lengths, strict=True)):
                stage.caches[request] = _unstacked(out.past_key_values, row, drop=longest - length)
        hidden = out.last_hidden_state  # (k, T, H)
        if stage.last:
            logits = stage.head(hidden[:, -1:])[:, -1]  # (k, V)
            result = torch.cat(
                [stage.pickers[r](logits[row : row + 1]).cpu() for row, r in enumerate(requests)]
            )  # (k,)
        else:
            result = hidden.to(stage.wire_dtype).cpu()
        stage.compute_s.append(time.perf_counter() - started)
        stage.batch_sizes.append(rows)
    stage.bytes_sent += result.numel() * result.element_size()
    return result


# ---------------------------------------------------------------------- on the driver


class PipelineClosed(RuntimeError):
    """The pipeline has stopped (the server is going down, or a stage was lost)."""


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list[int]
    sampling: Sampling
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    handed: queue.SimpleQueue[int | None] = field(default_factory=queue.SimpleQueue)
    """Its token ids as the scheduler hands them out, then None once it has ended (its slot
    releases sent): read by its caller's thread, never by the scheduler's."""
    error: BaseException | None = None
    opened: bool = False
    cancelled: bool = False
    """Its caller has stopped reading: it ends when the step it is in comes back."""
    finished: bool = False
    releases: list[Any] = field(default_factory=list)


@dataclass
class _Step:
    """A micro-batch on its way down the stages."""

    requests: list[_Request]
    stage: int = 0
    launched: float = field(default_factory=time.perf_counter)


class Pipeline:
    """The driver's scheduler over a `ShardedModel`'s stages: `generate` from any number of
    threads (at most `max_concurrent` at once), `in_flight` micro-batches moving at a time."""

    def __init__(
        self,
        sharded: Any,
        *,
        max_concurrent: int,
        in_flight: int,
        eos_token_id: int | None,
    ) -> None:
        if max_concurrent < 1 or in_flight < 1:
            raise ValueError("max_concurrent and in_flight must be at least 1")
        self.sharded = sharded
        self.max_concurrent, self.in_flight = max_concurrent, in_flight
        self.eos = eos_token_id
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.ready: deque[_Request] = deque()
        self.joining: deque[_Request] = deque()
        self.active = 0
        self.moving: list[_Step] = []
        self.lock = threading.Lock()
        self.closing = False
        self.failure: BaseException | None = None
        self.steps = 0
        self.batched_rows = 0
        self.releases: list[Any] = []
        """The slot releases sent to the stages (`close` waits for them)."""
        self.thread = threading.Thread(target=self._loop, name="pipeline", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ callers' side

    def generate(
        self,
        prompt: list[int],
        sampling: Sampling,
        *,
        max_new_tokens: int,
        on_token: Callable[[int], None],
    ) -> list[int]:
        """The new tokens of `prompt`, computed beside the other requests in flight.
        `on_token` runs here, on the caller's thread, as each id is handed over (the
        scheduler's thread never waits for it); what it raises (a client gone, a stop string)
        ends the request and propagates here once its slots are freed."""
        with self.lock:
            if self.failure is not None or self.closing:
                raise PipelineClosed(f"the pipeline has stopped: {self.failure}")
            if self.active >= self.max_concurrent:
                raise RuntimeError(
                    f"over split.max_concurrent={self.max_concurrent}: the caller bounds it"
                )
            self.active += 1
            request = _Request(next(self.sharded._requests), list(prompt), sampling, max_new_tokens)
        self.events.put(("join", request))
        raised: BaseException | None = None
        while (token := self._handed(request)) is not None:
            if raised is not None:
                continue  # cancelled: what was computed meanwhile is dropped
            try:
                on_token(token)
            except BaseException as exc:
                raised = exc
                self.events.put(("cancel", request))
        for future in request.releases:  # its slots are free when it returns (not the scheduler
            with contextlib.suppress(RuntimeError):  # waiting: this is the caller's thread)
                future.wait()
        if raised is not None:
            raise raised
        if request.error is not None:
            raise request.error
        return request.tokens

    def _handed(self, request: _Request) -> int | None:
        """The request's next token id, or None once it has ended."""
        while True:
            try:
                return request.handed.get(timeout=WAIT_S)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise PipelineClosed(f"the pipeline has stopped: {self.failure}") from None

    def close(self) -> None:
        """Stop after the steps in flight; requests still running end with PipelineClosed."""
        self.closing = True
        self.events.put(("close",))
        self.thread.join(timeout=self.sharded.timeout_s + WAIT_S)
        for future in list(self.releases):
            with contextlib.suppress(RuntimeError):
                future.wait()

    # ------------------------------------------------------------------ the scheduler

    def _loop(self) -> None:
        while True:
            try:
                event = self.events.get(timeout=WAIT_S)
            except queue.Empty:
                if self.moving:
                    oldest = min(step.launched for step in self.moving)
                    log.info(
                        "%d micro-batches in flight, the oldest for %.0f s on stage %d "
                        "(split.rpc_timeout_s=%g)",
                        len(self.moving),
                        time.perf_counter() - oldest,
                        self.moving[0].stage + 1,
                        self.sharded.timeout_s,
                    )
                continue
            if event[0] == "close":
                self._fail_all(PipelineClosed("the server is stopping"))
                return
            try:
                if event[0] == "join":
                    self.joining.append(event[1])
                elif event[0] == "cancel":
                    self._cancel(event[1])
                else:
                    self._stepped(event[1], event[2])
                self._launch()
            except Exception as exc:  # the scheduler must not die with requests waiting on it
                log.exception("the pipeline's scheduler failed")
                self.failure = exc
                self._fail_all(PipelineClosed(f"the pipeline failed: {exc}"))
                return

    def _launch(self) -> None:
        """Fill the pipeline: new requests' prefills first (they join between tokens), then
        micro-batches of ready requests, about an equal share of those active each."""
        while len(self.moving) < self.in_flight and (self.joining or self.ready):
            if self.joining:
                batch = [self.joining.popleft()]
            else:
                running = len(self.ready) + sum(len(s.requests) for s in self.moving)
                size = max(1, math.ceil(running / self.in_flight))
                batch = [self.ready.popleft() for _ in range(min(size, len(self.ready)))]
            step = _Step(batch)
            self.moving.append(step)
            self._call(step, self._first_input(batch))

    def _first_input(self, batch: list[_Request]) -> torch.Tensor:
        if len(batch) == 1 and not batch[0].opened:
            return torch.tensor([batch[0].prompt], dtype=torch.long)  # (1, T)
        return torch.tensor([[r.tokens[-1]] for r in batch], dtype=torch.long)  # (k, 1)

    def _call(self, step: _Step, x: torch.Tensor) -> None:
        opening = [None if r.opened else r.sampling.as_dict() for r in step.requests]
        ids = [r.id for r in step.requests]
        future = self.sharded.call_async(step.stage, "step", x, ids, opening)
        # runs on a TensorPipe thread: hand over, never wait
        future.add_done_callback(lambda done: self.events.put(("step", step, done)))

    def _stepped(self, step: _Step, future: Any) -> None:
        try:
            result = future.wait()
        except Exception as exc:  # (a stage's own ValueError comes back as itself)
            self.moving.remove(step)
            error = self.sharded._lost(step.stage, exc, call="a generation step")
            if getattr(error, "peer", None) is None:  # every stage still answers: a refused or
                log.error(  # failed step (out of memory, say) ends its own requests, no others
                    "a micro-batch of %d requests failed, the stages still answer (the other "
                    "requests go on): %s",
                    len(step.requests),
                    error,
                )
                for request in step.requests:
                    self._finish(request, error)  # and frees their slots on every stage
                return
            log.error("a micro-batch of %d requests failed: %s", len(step.requests), error)
            self.failure = error  # a stage is gone: no new request can be served
            for request in step.requests:
                self._finish(request, error, release=False)
            return
        if step.stage + 1 < len(self.sharded.stages):
            step.stage += 1
            self._call(step, result)
            return
        self.moving.remove(step)
        self.steps += 1
        self.batched_rows += len(step.requests)
        for request, token in zip(step.requests, result.tolist(), strict=True):
            request.opened = True
            if request.cancelled:  # its caller stopped reading while this step ran
                self._finish(request, None)
                continue
            request.tokens.append(int(token))
            request.handed.put(int(token))  # to its caller's thread: no serving work here
            if len(request.tokens) >= request.max_new_tokens or token == self.eos:
                self._finish(request, None)
            else:
                self.ready.append(request)

    def _cancel(self, request: _Request) -> None:
        """Its caller stopped reading (a client gone, a stop string): end it now if it waits
        for a step, or when the step it is in comes back."""
        if request.finished:
            return
        for waiting in (self.joining, self.ready):
            if request in waiting:
                waiting.remove(request)
                self._finish(request, None, release=request.opened)
                return
        request.cancelled = True

    def _finish(
        self, request: _Request, error: BaseException | None, *, release: bool = True
    ) -> None:
        if release:
            self.releases = [f for f in self.releases if not f.done()]
            for index in range(len(self.sharded.stages)):  # its slot, on every stage
                future = self.sharded.call_async(index, "end_request", request.id)
                future.add_done_callback(lambda done: _log_failure(done, request.id))
                self.releases.append(future)
                request.releases.append(future)
        request.error = error
        request.finished = True
        with self.lock:
            self.active -= 1
        request.handed.put(None)

    def _fail_all(self, error: BaseException) -> None:
        waiting = list(self.joining) + list(self.ready)
        waiting += [r for step in self.moving for r in step.requests]
        self.joining.clear()
        self.ready.clear()
        self.moving.clear()
        for request in waiting:
            self._finish(request, error)

    def stats(self) -> dict[str, float]:
        """Steps run and their mean micro-batch size (how much batching happened)."""
        return {
            "steps": float(self.steps),
            "mean_batch": self.batched_rows / self.steps if self.steps else 0.0,
        }


def _log_failure(future: Any, request: int) -> None:
    try:
        future.wait()
    except RuntimeError as exc:
        log.warning("request %d: freeing its slot failed: %s", request, str(exc)[:200])
