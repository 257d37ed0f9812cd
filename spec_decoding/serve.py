"""`python -m spec_decoding role=serve`: speculative decoding behind an OpenAI-compatible endpoint.

Runs on the drafter's host: it loads the draft, connects to a running verifier
(`role=verifier`, at spec.verifier) and answers `/v1/completions` and `/v1/chat/completions`
(`lab.serving`), up to `spec.serve_sessions` generations at once, each a `Drafter.generate`
session of its own against the verifier (which batches their forwards), its confirmed tokens
streamed as they come. A generation cut short (its client gone, or a stop string) closes its
connection, which ends the session on the verifier; the next request on that drafter dials
again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from lab.cli import ConfigError
from lab.cluster import connect_when_ready, emulated_link
from lab.models import load_model, load_tokenizer
from lab.openai_http import serve
from lab.serving import Cancelled, Params
from netproto import Connection, ConnectionClosed, NetTimeout
from spec_decoding.config import SpecDecodingRunConfig
from spec_decoding.drafter import Drafter, VerifierLostError, drafter_for

log = logging.getLogger(__name__)


class SpecEngine:
    """`lab.serving.Engine` over drafters and their verifier: `slots` generations at once, each
    on a drafter of its own (its own connection, session and window; the draft model shared,
    read-only)."""

    def __init__(
        self, make: Callable[[Connection], Drafter], dial: Callable[[], Connection], *, slots: int
    ) -> None:
        """`make`: a drafter on a connection; `dial`: a new connection to the verifier."""
        self.make, self.dial, self.slots = make, dial, slots
        self.max_concurrent, self.slots_key = slots, f"spec.serve_sessions={slots}"  # lab.serving
        first = make(dial())  # the verifier answers, or the role ends before serving
        self.idle: list[Drafter] = [first]
        self.busy = 0
        self.lost = 0
        """Sessions ended by a failure (the verifier lost, or the generation cut short)."""
        self.peer = str(first.conn.peer)
        self._lock = threading.Lock()
        context = getattr(first.model.config, "max_position_embeddings", None)
        self.context_tokens = context if isinstance(context, int) and context > 0 else None

    def _take(self) -> Drafter:
        with self._lock:
            self.busy += 1
            if self.idle:
                return self.idle.pop()
        try:
            return self.make(self.dial())
        except BaseException:
            with self._lock:
                self.busy -= 1
            raise

    def generate(
        self, prompt: list[int], params: Params, on_tokens: Callable[[list[int]], None]
    ) -> list[int]:
        drafter = self._take()
        healthy = False
        try:
            drafter.temperature, drafter.top_p = params.temperature, params.top_p
            generation = drafter.generate(
                prompt,
                max_new_tokens=params.max_new_tokens,
                seed=params.seed,
                on_tokens=on_tokens,
            )
            healthy = True
        except BaseException as exc:  # cut short, or the verifier lost: this session is over
            drafter.conn.close()
            self.lost += 1
            if isinstance(exc, Cancelled | VerifierLostError):
                raise
            raise VerifierLostError(f"the session with the verifier failed: {exc}") from exc
        finally:
            with self._lock:
                self.busy -= 1
                if healthy:
                    self.idle.append(drafter)
        return list(generation.tokens)

    def health(self) -> dict[str, Any]:
        with self._lock:
            connected = len(self.idle) + self.busy
        return {
            "verifier_connected": connected > 0,
            "verifier": self.peer,
            "sessions": {"generating": self.busy, "idle": len(self.idle), "slots": self.slots},
        }

    def close(self) -> None:
        with self._lock:
            for drafter in self.idle:
                drafter.conn.close()
            self.idle = []


def serve_role(settings: SpecDecodingRunConfig) -> dict[str, float]:
    """`role=serve`: the endpoint on the drafter's host, until SIGINT or SIGTERM."""
    verifier, cluster, spec = settings.spec.verifier, settings.cluster, settings.spec
    if verifier.port == 0:
        raise ConfigError("role=serve needs spec.verifier.port: the verifier's, not 0")
    cache_dir = settings.paths.cache_path
    model = load_model(settings.draft, cache_dir=cache_dir, key="draft")
    tokenizer = load_tokenizer(settings.draft, cache_dir=cache_dir, key="draft")
    with ExitStack() as stack:
        address = stack.enter_context(emulated_link(cluster, (verifier.host, verifier.port)))

        def dial() -> Connection:
            log.info(
                "connecting to the verifier at %s:%d (cluster.connect_timeout_s=%g)",
                verifier.host,
                verifier.port,
                cluster.connect_timeout_s,
            )
            try:
                return connect_when_ready(cluster, address, wait_s=cluster.connect_timeout_s)
            except (ConnectionClosed, NetTimeout) as exc:
                raise VerifierLostError(
                    f"no verifier answering at {verifier.host}:{verifier.port} ({exc})"
                ) from None

        engine = SpecEngine(
            lambda conn: drafter_for(model, tokenizer, conn, spec),
            dial,
            slots=spec.serve_sessions,
        )
        try:
            serve(
                engine,
                tokenizer,
                model_id=settings.serve.model_id or settings.target.name,
                config=settings.serve,
                secret=cluster.resolved_secret(),
            )
        finally:
            engine.close()
    return {}
