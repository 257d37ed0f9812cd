"""`python -m spec_decoding role=serve`: speculative decoding behind an OpenAI-compatible endpoint.

Runs on the drafter's host: it loads the draft, connects to a running verifier
(`role=verifier`, at cluster.verifier) and answers `/v1/completions` and `/v1/chat/completions`
(`lab.serving`) one generation at a time, each a `Drafter.generate` session against the
verifier, its confirmed tokens streamed as they come. A generation cut short (its client gone,
or a stop string) closes the connection, which ends the session on the verifier; the next
request dials again.
"""

from __future__ import annotations

import logging
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
    """`lab.serving.Engine` over a drafter and its verifier."""

    def __init__(self, drafter: Drafter, dial: Callable[[], Connection]) -> None:
        self.drafter, self.dial = drafter, dial
        self.connected = True
        context = getattr(drafter.model.config, "max_position_embeddings", None)
        self.context_tokens = context if isinstance(context, int) and context > 0 else None

    def generate(
        self, prompt: list[int], params: Params, on_tokens: Callable[[list[int]], None]
    ) -> list[int]:
        if not self.connected:
            self.drafter.conn = self.dial()
            self.connected = True
        self.drafter.temperature, self.drafter.top_p = params.temperature, params.top_p
        try:
            generation = self.drafter.generate(
                prompt, max_new_tokens=params.max_new_tokens, seed=params.seed,
                on_tokens=on_tokens,
            )  # fmt: skip
        except BaseException as exc:  # cut short, or the verifier lost: this session is over
            self.drafter.conn.close()
            self.connected = False
            if isinstance(exc, Cancelled | VerifierLostError):
                raise
            raise VerifierLostError(f"the session with the verifier failed: {exc}") from exc
        return list(generation.tokens)

    def health(self) -> dict[str, Any]:
        return {"verifier_connected": self.connected, "verifier": str(self.drafter.conn.peer)}


def serve_role(settings: SpecDecodingRunConfig) -> dict[str, float]:
    """`role=serve`: the endpoint on the drafter's host, until SIGINT or SIGTERM."""
    verifier, cluster, spec = settings.cluster.verifier, settings.cluster, settings.spec
    if verifier.port == 0:
        raise ConfigError("role=serve needs cluster.verifier.port (the verifier's port)")
    cache_dir = settings.paths.cache_path
    model = load_model(settings.draft, cache_dir=cache_dir, key="draft")
    tokenizer = load_tokenizer(settings.draft, cache_dir=cache_dir, key="draft")
    with ExitStack() as stack:
        address = stack.enter_context(emulated_link(cluster, (verifier.host, verifier.port)))

        def dial() -> Connection:
            log.info(
                "connecting to the verifier at %s:%d (cluster.connect_timeout_s=%g)",
                verifier.host, verifier.port, cluster.connect_timeout_s,
            )  # fmt: skip
            try:
                return connect_when_ready(cluster, address, wait_s=cluster.connect_timeout_s)
            except (ConnectionClosed, NetTimeout) as exc:
                raise VerifierLostError(
                    f"no verifier answering at {verifier.host}:{verifier.port} ({exc})"
                ) from None

        drafter = drafter_for(model, tokenizer, dial(), spec)
        engine = SpecEngine(drafter, dial)
        try:
            serve(
                engine,
                tokenizer,
                model_id=settings.serve.model_id or settings.target.name,
                config=settings.serve,
                secret=cluster.resolved_secret(),
            )
        finally:
            drafter.conn.close()
    return {}
