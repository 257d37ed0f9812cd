"""An OpenAI-compatible HTTP endpoint over any of the lab's single-stream generators.

`python -m split_inference role=serve` and `python -m spec_decoding role=serve` each wrap their
own generation in an `Engine` (one prompt in, its new token ids out, each step's tokens handed
to a callback) and call `lab.openai_http.serve(engine, ...)`: FastAPI on uvicorn, `/v1/completions`,
`/v1/chat/completions`, `/v1/models`, `stream=true` as server-sent events (sse-starlette),
errors in OpenAI's JSON shape. The engines run one generation at a time, so requests queue for
one slot in front of them; the generation runs in a worker thread, off the event loop, and a
client that goes away (or a stop string) cancels it at its next token: the callback raises
`Cancelled`, the engine frees what the request held, and the slot goes to the next request.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from lab.config import check_positive

log = logging.getLogger(__name__)

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
"""For a tokenizer without a chat template (the lab's tiny models): one `role: content` line
per message, then `assistant:`. Start-up says when it is used."""

WAIT_LOG_S = 30.0
"""A queued request says again that it waits, this often (the first line at once)."""
DISCONNECT_POLL_S = 0.5
"""How often a waiting or generating request checks that its client is still there."""


@dataclass
class ServeConfig:
    """`role=serve`: the OpenAI-compatible HTTP endpoint (`serve.*` in the experiment's config)."""

    host: str = "127.0.0.1"
    """The address it listens on: loopback unless you set it (then set a secret: it is the
    bearer key; without one any local user, and anyone who reaches the address, can call it)."""
    port: int = 8000
    model_id: str = ""
    """The name clients give as `model` (and `/v1/models` lists); empty: the model's name."""
    default_max_tokens: int = 64
    """New tokens for a request that does not set max_tokens."""
    max_tokens_limit: int = 1024
    """Most new tokens one request may ask for (more is refused with a 400)."""
    max_prompt_tokens: int = 2048
    """Longest prompt, in tokens, after the chat template (longer is refused with a 400)."""
    max_queue: int = 32
    """Requests that may wait for a generation slot; more are refused with a 429."""
    queue_timeout_s: float = 120.0
    """Longest a request waits for the slot; then it is answered 503 (and the log says so)."""
    max_body_kib: int = 1024
    """Largest request body accepted, checked before it is read (413 beyond)."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("serve.host must not be empty")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"serve.port={self.port} must be in 1..65535")
        for name in ("default_max_tokens", "max_tokens_limit", "max_prompt_tokens", "max_body_kib"):
            check_positive(f"serve.{name}", getattr(self, name))
        check_positive("serve.max_queue", self.max_queue, allow_zero=True)
        check_positive("serve.queue_timeout_s", self.queue_timeout_s)
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"serve.default_max_tokens={self.default_max_tokens} is over "
                f"serve.max_tokens_limit={self.max_tokens_limit}"
            )


class Cancelled(Exception):
    """Raised by the token callback to end a generation: its client left, or a stop string."""


@dataclass(frozen=True)
class Params:
    """One request's generation settings, checked."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int


class Engine(Protocol):
    """One generation at a time: `generate` returns the new token ids of `prompt` (ids), calling
    `on_tokens(tokens_so_far)` as they are confirmed (it may raise `Cancelled`: the engine then
    frees what the request held and lets it propagate). An engine with an int `max_concurrent`
    runs up to that many generations at once, each `generate` in its own worker thread, and
    names the key that sets it in `slots_key` (said to a request that waits)."""

    context_tokens: int | None
    """Most tokens a request may span, prompt and new ones (the model's context), if known."""

    def generate(
        self, prompt: list[int], params: Params, on_tokens: Callable[[list[int]], None]
    ) -> list[int]: ...

    def health(self) -> dict[str, Any]:
        """What it holds now (open requests on every process), for `/health`."""
        ...


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", **extra: Any
    ) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind
        self.param, self.code = extra.get("param"), extra.get("code")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class Text:
    """The text of a growing token list, handed out in pieces that never split a character or
    the start of a stop string; `final()` is the whole text, cut at a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], eos: int | None) -> None:
        self.tokenizer, self.stops, self.eos = tokenizer, [s for s in stops if s], eos
        self.sent = ""
        self.stopped = False

    def text(self, tokens: list[int]) -> str:
        if self.eos is not None and self.eos in tokens:
            tokens = tokens[: tokens.index(self.eos)]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in self.stops if stop in text]
        if cuts:
            self.stopped = True
            return text[: min(cuts)]
        return text

    def delta(self, tokens: list[int]) -> str:
        text = self.text(tokens)
        safe = len(text.rstrip("\ufffd"))  # a character whose bytes have not all come
        if not self.stopped:
            for stop in self.stops:  # a stop string may be starting: hold its first part back
                for size in range(min(len(stop) - 1, safe), 0, -1):
                    if text[:safe].endswith(stop[:size]):
                        safe -= size
                        break
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent) : safe], text[:safe]
        return piece


class Server:
    """The endpoint's state: the engine, its one slot and the requests waiting for it."""

    def __init__(
        self, engine: Engine, tokenizer: Any, *, model_id: str, config: ServeConfig,
        secret: bytes | None,
    ) -> None:  # fmt: skip
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.config, self.secret = config, secret
        self.chat_template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        slots = self.slots = max(1, int(getattr(engine, "max_concurrent", 1)))
        self.slots_key = str(getattr(engine, "slots_key", "one generation at a time"))
        self.slot = asyncio.Semaphore(slots)
        self.waiting = 0
        self.generating = 0
        self.ids = itertools.count(1)
        self.worker = threading.BoundedSemaphore(slots)  # asserts the engine's bound
        self.executor = ThreadPoolExecutor(slots, thread_name_prefix="generation")
        self.running: set[threading.Event] = set()
        self.served = 0
        self.cancelled = 0
        self.request_cpu_s = 0.0
        """CPU seconds the requests' worker threads have spent in `generate`: for an engine that
        steps elsewhere (the split's pipeline, transformers' continuous batching) each request's
        own serving work, its detokenizing and hand-over (`/health` reports it)."""
        self.counts = threading.Lock()
        self.summary = Summary()

    # ------------------------------------------------------------------ requests

    def check_key(self, authorization: str | None) -> None:
        if self.secret is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip().encode()
        if not hmac.compare_digest(given, self.secret):
            raise ApiError(
                401,
                "Incorrect API key provided: give the run's shared secret as the API key "
                "(LAB_SECRET or cluster.secret_file on the server)",
                code="invalid_api_key",
            )

    def params(self, body: dict[str, Any]) -> Params:
        """The generation settings of a request body, or a 400 naming the field."""
        model = body.get("model")
        if model != self.model_id:
            raise ApiError(
                404,
                f"The model `{model}` does not exist: this server serves `{self.model_id}`",
                param="model",
                code="model_not_found",
            )
        limit = self.config.max_tokens_limit
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if type(max_tokens) is not int or not 1 <= max_tokens <= limit:
            raise ApiError(
                400,
                f"max_tokens={max_tokens!r} must be an integer in 1..{limit} "
                f"(serve.max_tokens_limit={limit})",
                param="max_tokens",
            )
        temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
        top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
        if top_p == 0:
            raise ApiError(400, "top_p=0 keeps no token: it must be in (0, 1]", param="top_p")
        seed = body.get("seed")
        if seed is None:
            seed = next(self.ids) if temperature > 0 else 0
        if type(seed) is not int or not 0 <= seed < 2**63:
            raise ApiError(400, f"seed={seed!r} must be an integer >= 0", param="seed")
        if body.get("n", 1) != 1:
            raise ApiError(400, "n must be 1: this server makes one choice", param="n")
        return Params(max_tokens, temperature, top_p, seed)

    def stops(self, body: dict[str, Any]) -> list[str]:
        stop = body.get("stop")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if (
            not isinstance(stops, list)
            or len(stops) > 4
            or not all(isinstance(s, str) and len(s) <= 256 for s in stops)
        ):
            raise ApiError(400, "stop must be a string or up to 4 strings", param="stop")
        return stops

    def prompt_ids(self, body: dict[str, Any], *, chat: bool, max_new_tokens: int) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            plain = [_message(m, index) for index, m in enumerate(messages)]
            ids = self.tokenizer.apply_chat_template(
                plain, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
            )
            ids = self.tokenizer(ids, add_special_tokens=False)["input_ids"]
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str) or not prompt:
                raise ApiError(400, "prompt must be one non-empty string", param="prompt")
            ids = self.tokenizer(prompt)["input_ids"]
        limit = self.config.max_prompt_tokens
        context = self.engine.context_tokens
        if context is not None and len(ids) + max_new_tokens > context:
            raise ApiError(
                400,
                f"the prompt ({len(ids)} tokens) and max_tokens={max_new_tokens} are over "
                f"the model's context of {context} tokens",
                param="max_tokens",
            )
        if len(ids) > limit:
            raise ApiError(
                400,
                f"the prompt is {len(ids)} tokens, over serve.max_prompt_tokens={limit}",
                param="messages" if chat else "prompt",
            )
        return list(ids)

    # ------------------------------------------------------------------ the slot

    async def take_slot(self, request_id: str, disconnected: Callable[[], Any]) -> bool:
        """Wait for the generation slot (False: the client left meanwhile). 429 when too many
        wait, 503 after serve.queue_timeout_s; a wait says so at once and every 30 s."""
        if self.slot.locked() and self.waiting >= self.config.max_queue:
            raise ApiError(
                429,
                f"the server is busy: {self.waiting} requests wait already "
                f"(serve.max_queue={self.config.max_queue}); retry later",
                kind="server_error",
                code="queue_full",
            )
        self.waiting += 1
        started = time.monotonic()
        said = -WAIT_LOG_S
        try:
            while True:
                waited = time.monotonic() - started
                if self.slot.locked() and waited - said >= WAIT_LOG_S:
                    said = waited
                    log.info(
                        "request %s waits for the generation slot (%s; %d waiting, %.0f s of "
                        "serve.queue_timeout_s=%g)",
                        request_id, self.slots_key, self.waiting, waited,
                        self.config.queue_timeout_s,
                    )  # fmt: skip
                left = self.config.queue_timeout_s - waited
                if left <= 0:
                    log.warning(
                        "request %s gave up after waiting %.0f s for the slot "
                        "(serve.queue_timeout_s=%g)",
                        request_id, waited, self.config.queue_timeout_s,
                    )  # fmt: skip
                    raise ApiError(
                        503,
                        f"no generation slot within serve.queue_timeout_s="
                        f"{self.config.queue_timeout_s:g}: retry later",
                        kind="server_error",
                        code="queue_timeout",
                    )
                try:
                    await asyncio.wait_for(self.slot.acquire(), min(left, DISCONNECT_POLL_S))
                    return True
                except TimeoutError:
                    if await disconnected():
                        log.info("request %s: client left while waiting", request_id)
                        return False
        finally:
            self.waiting -= 1

    def start(
        self, request_id: str, prompt: list[int], params: Params, text: Text,
        pieces: asyncio.Queue[str | None] | None,
    ) -> tuple[asyncio.Future[list[int]], threading.Event]:  # fmt: skip
        """Run the generation in a worker thread (the slot held: it is released when the
        thread ends, not when the client goes). Returns its future and its cancel switch."""
        loop = asyncio.get_running_loop()
        cancel = threading.Event()

        seen: list[int] = []  # the tokens so far: a generation cut short returns them

        def on_tokens(tokens: list[int]) -> None:
            tokens = tokens[: params.max_new_tokens]
            seen[:] = tokens
            if pieces is not None:
                piece = text.delta(tokens)
                if piece:
                    loop.call_soon_threadsafe(pieces.put_nowait, piece)
            else:
                text.text(tokens)
            if cancel.is_set() or text.stopped:
                raise Cancelled

        def work() -> list[int]:
            with self.worker:
                begun, cpu = time.perf_counter(), time.thread_time()
                with self.counts:  # (up to max_concurrent worker threads count at once)
                    self.generating += 1
                tokens: list[int] = []
                try:
                    tokens = self.engine.generate(prompt, params, on_tokens)
                except Cancelled:
                    tokens = list(seen)
                    if cancel.is_set():
                        with self.counts:
                            self.cancelled += 1
                finally:
                    with self.counts:
                        self.generating -= 1
                        self.request_cpu_s += time.thread_time() - cpu
                    self.summary.add(len(seen), time.perf_counter() - begun)
                    log.info(
                        "request %s: %d prompt tokens, %d new, %s in %.0f ms",
                        request_id, len(prompt), len(seen),
                        "cancelled" if cancel.is_set() else "stopped" if text.stopped else "done",
                        (time.perf_counter() - begun) * 1e3,
                    )  # fmt: skip
                return tokens

        self.running.add(cancel)
        future = loop.run_in_executor(self.executor, work)

        def done(_: object) -> None:
            self.running.discard(cancel)
            self.slot.release()

        future.add_done_callback(done)
        return future, cancel

    def stop(self) -> None:
        """Cancel what still generates and wait for the worker (the engine is then free)."""
        for cancel in list(self.running):
            cancel.set()
        self.executor.shutdown(wait=True)


SUMMARY_S = 60.0
"""The server logs a summary of the requests it served this often (while it serves any)."""


class Summary:
    """Requests served, tokens and throughput since the last summary line."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.since = clock()
        self.requests = self.tokens = 0
        self.request_s: list[float] = []
        self.lock = threading.Lock()

    def add(self, tokens: int, seconds: float) -> None:
        with self.lock:
            self.requests += 1
            self.tokens += tokens
            self.request_s.append(seconds)

    def line(self, *, generating: int, waiting: int) -> str | None:
        """The summary since the last one (None when nothing was served or is waiting), and a
        new period begins."""
        with self.lock:
            now = self.clock()
            elapsed, self.since = max(now - self.since, 1e-9), now
            requests, tokens, times = self.requests, self.tokens, sorted(self.request_s)
            self.requests = self.tokens = 0
            self.request_s = []
        if not requests and not generating and not waiting:
            return None
        p50 = times[len(times) // 2] * 1e3 if times else 0.0
        p95 = times[min(len(times) - 1, int(len(times) * 0.95))] * 1e3 if times else 0.0
        return (
            f"last {elapsed:.0f} s: {requests} requests served, {tokens} tokens "
            f"({tokens / elapsed:.1f} tokens/s), request ms p50 {p50:.0f} p95 {p95:.0f}; "
            f"{generating} generating, {waiting} waiting"
        )


def _number(body: dict[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"{key}={value!r} must be a number in [{low:g}, {high:g}]", param=key)
    return float(value)


def _message(message: Any, index: int) -> dict[str, str]:
    """A chat message as the template takes it: role and text content."""
    bad = ApiError(
        400,
        f"messages[{index}] must be an object with a role (system, user, assistant) and "
        "text content",
        param=f"messages[{index}]",
    )
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
        raise bad
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise bad
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise bad
    return {"role": message["role"], "content": content}
