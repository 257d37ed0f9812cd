"""The verifier: holds the target model and checks drafts in one forward pass each.

One netproto session per drafter connection, each with its own KV cache (freed when the
connection ends, whatever the reason). A malformed or out-of-session request gets an ERROR and
closes that session only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any

import torch

from netproto import Connection, PeerProtocolError
from spec_decoding.cache import CachedDecoder
from spec_decoding.config import MAX_GAMMA
from spec_decoding.protocol import SpecMsg
from spec_decoding.sampling import greedy_verdict, probs_from_logits, speculative_verdict

log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 8192
MAX_BASELINE_TOKENS = 4096


def vocab_hash(tokenizer: Any) -> str:
    """Fingerprint of a tokenizer's vocabulary: drafts only make sense over the same one."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


class BadRequest(ValueError):
    """A drafter's request that the protocol carried but that makes no sense."""


def _check_tokens(tokens: list[Any], vocab_size: int, what: str) -> list[int]:
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in tokens):
        raise BadRequest(f"{what} holds token ids outside 0..{vocab_size - 1}")
    return tokens


def _sampling_params(body: dict[str, Any]) -> tuple[float, float, int]:
    temperature, top_p, seed = (
        body.get("temperature", 0.0),
        body.get("top_p", 1.0),
        body.get("seed", 0),
    )
    if not isinstance(temperature, int | float) or temperature < 0:
        raise BadRequest("temperature must be a number >= 0")
    if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]")
    if not isinstance(seed, int):
        raise BadRequest("seed must be an integer")
    return float(temperature), float(top_p), seed


class Verifier:
    """The target model and what every session shares (model weights are read-only)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        """`model`: a Hugging Face causal LM (has `.config` and `.generate`)."""
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.vocab_hash = vocab_hash(tokenizer)
        self.sessions_opened = 0
        self.active_sessions = 0
        self._lock = threading.Lock()

    def handle(self, conn: Connection) -> None:
        """A netproto session handler: serve one drafter until it closes."""
        with self._lock:
            self.sessions_opened += 1
            self.active_sessions += 1
        session: _Session | None = None
        try:
            while True:
                message = conn.recv(expect=set(SpecMsg))
                try:
                    if message.type == SpecMsg.OPEN:
                        session = _Session.open(self, message.payload)
                        conn.send_msg(
                            SpecMsg.OPENED,
                            {"vocab_size": self.vocab_size, "prefill_ms": session.prefill_ms},
                            request_id=message.request_id,
                        )
                    elif message.type == SpecMsg.DRAFT:
                        if session is None:
                            raise BadRequest("DRAFT before OPEN: no session")
                        conn.send_msg(
                            SpecMsg.VERDICT,
                            session.verify(message.payload),
                            request_id=message.request_id,
                        )
                    elif message.type == SpecMsg.BASELINE:
                        conn.send_msg(
                            SpecMsg.BASELINE_DONE,
                            self.baseline(message.payload),
                            request_id=message.request_id,
                        )
                    elif message.type == SpecMsg.CLOSE:
                        session = None
                    else:
                        raise BadRequest(f"unexpected message {message.type:#06x}")
                except BadRequest as exc:
                    conn.send_error("bad_request", str(exc), request_id=message.request_id)
                    raise PeerProtocolError(f"bad request from {conn.peer}: {exc}") from None
        finally:
            session = None  # the cache goes with the session
            with self._lock:
                self.active_sessions -= 1

    @torch.inference_mode()  # as our own decoding runs: a like-for-like baseline
    def baseline(self, body: dict[str, Any]) -> dict[str, Any]:
        """Target-only generation with Hugging Face `generate`, timed here (no network)."""
        prompt = _check_tokens(list(body.get("prompt", [])), self.vocab_size, "prompt")
        max_new = body.get("max_new_tokens")
        if not prompt or not isinstance(max_new, int) or not 1 <= max_new <= MAX_BASELINE_TOKENS:
            raise BadRequest(
                f"BASELINE needs a prompt and max_new_tokens in 1..{MAX_BASELINE_TOKENS}"
            )
        temperature, top_p, seed = _sampling_params(body)
        torch.manual_seed(seed)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([prompt], device=device)
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": top_p}
            if temperature > 0
            else {"do_sample": False}
        )
        started = time.perf_counter()
        output = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            **sampling,
        )
        seconds = time.perf_counter() - started
        return {"tokens": output[0, len(prompt) :].tolist(), "seconds": seconds}


class _Session:
    """One drafter's generation: its committed tokens, KV cache and random stream."""

    def __init__(
        self, verifier: Verifier, prompt: list[int], temperature: float, top_p: float, seed: int
    ) -> None:
        self.verifier = verifier
        self.decoder = CachedDecoder(verifier.model, prompt)
        self.temperature = temperature
        self.top_p = top_p
        self.generator = torch.Generator().manual_seed(seed)
        started = time.perf_counter()
        self.decoder.prefill()
        self.prefill_ms = (time.perf_counter() - started) * 1e3

    @classmethod
    def open(cls, verifier: Verifier, body: dict[str, Any]) -> _Session:
        if body.get("vocab_hash") != verifier.vocab_hash:
            raise BadRequest(
                "the draft model's tokenizer differs from the target's; "
                "speculative decoding needs both to share one vocabulary"
            )
        prompt = list(body.get("prompt", []))
        if not 1 <= len(prompt) <= MAX_PROMPT_TOKENS:
            raise BadRequest(f"prompt must hold 1..{MAX_PROMPT_TOKENS} tokens")
        _check_tokens(prompt, verifier.vocab_size, "prompt")
        return cls(verifier, prompt, *_sampling_params(body))

    def verify(self, payload: dict[str, torch.Tensor]) -> dict[str, Any]:
        tokens = payload.get("tokens")
        if tokens is None or tokens.dim() != 1 or tokens.dtype != torch.int32:
            raise BadRequest("DRAFT needs an int32 vector `tokens`")
        if tokens.numel() > MAX_GAMMA:
            raise BadRequest(f"a draft holds at most {MAX_GAMMA} tokens")
        draft = _check_tokens(tokens.tolist(), self.verifier.vocab_size, "draft")
        started = time.perf_counter()
        logits = self.decoder.extend(draft)[-(len(draft) + 1) :]  # (k + 1, V)
        if self.temperature == 0:
            accepted, token = greedy_verdict(logits, draft)
        else:
            q = payload.get("q")
            if q is None or tuple(q.shape) != (len(draft), logits.size(-1)):
                raise BadRequest("sampling needs `q` of shape (k, vocab_size)")
            p = probs_from_logits(logits, temperature=self.temperature, top_p=self.top_p)
            accepted, token = speculative_verdict(p, q.float(), draft, generator=self.generator)
        self.decoder.commit([*draft[:accepted], token])
        return {
            "accepted": accepted,
            "token": token,
            "verify_ms": (time.perf_counter() - started) * 1e3,
        }
