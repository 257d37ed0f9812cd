"""The verifier: holds the target model and checks drafts in one forward pass each.

One netproto session per drafter connection, each with its own KV cache (freed when the
connection ends, whatever the reason). A malformed or out-of-session request gets an ERROR and
closes that session only. The sessions' forwards that are ready at the same moment run as one
batch (`spec_decoding/batching.py`, at most `spec.max_batch` sessions): each session's tokens are
still its own, and a forward that fails for one session fails that session only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from typing import Any

import torch

from lab.sampling import probs_from_logits
from netproto import Connection, PeerProtocolError
from spec_decoding.batching import BatchedTarget, cache_budget, cache_bytes_per_token
from spec_decoding.cache import CachedDecoder
from spec_decoding.config import MAX_BATCH_HOLD_MS, MAX_BRANCH_DEPTH, MAX_BRANCH_WIDTH, MAX_GAMMA
from spec_decoding.draft_q import BadDraftQ, decode_q
from spec_decoding.protocol import SpecMsg
from spec_decoding.sampling import (
    coupled_token,
    greedy_verdict,
    position_noise,
    speculative_verdict,
)

log = logging.getLogger(__name__)

MAX_SESSION_TOKENS = 8192
"""Most tokens a session (prompt and everything generated) or a BASELINE may span."""
MAX_BASELINE_TOKENS = 4096
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
"""Sampling temperatures a session may ask for (0 is greedy): below, logits / t overflow."""
MAX_SEED = 2**63 - 1
STREAM_FIELDS = frozenset({"tokens", "epoch", "at", "more"})
BRANCH_FIELDS = frozenset({"tokens", "epoch", "at"})


def vocab_hash(tokenizer: Any) -> str:
    """Fingerprint of a tokenizer's vocabulary: drafts only make sense over the same one."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


class BadRequest(ValueError):
    """A drafter's request that the protocol carried but that makes no sense."""


def session_cap(config: Any) -> int:
    """Most tokens a session may span: the target's context (its position limit), at most
    MAX_SESSION_TOKENS."""
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        return min(MAX_SESSION_TOKENS, context)
    return MAX_SESSION_TOKENS


def _check_tokens(tokens: list[Any], vocab_size: int, what: str) -> list[int]:
    if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise BadRequest(f"{what} holds token ids outside 0..{vocab_size - 1}")
    return tokens


def _prompt(body: dict[str, Any], verifier: Verifier, *, room: int) -> list[int]:
    """The request's prompt: a list of token ids, leaving `room` tokens of the session cap."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list):
        raise BadRequest("prompt must be a list of token ids")
    if not prompt or len(prompt) + room > verifier.max_tokens:
        raise BadRequest(
            f"a prompt of {len(prompt)} tokens with {room} more to come does not fit a "
            f"session of 1..{verifier.max_tokens} tokens"
        )
    return _check_tokens(prompt, verifier.vocab_size, "prompt")


def _number(value: Any) -> bool:
    """A finite JSON number; an int beyond 2**53 is refused (float() of 10**400 overflows)."""
    if type(value) is int:
        return abs(value) <= 2**53
    return type(value) is float and math.isfinite(value)


def _sampling_params(body: dict[str, Any]) -> tuple[float, float, int]:
    temperature, top_p, seed = (
        body.get("temperature", 0.0),
        body.get("top_p", 1.0),
        body.get("seed", 0),
    )
    if not _number(temperature) or not (
        temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE
    ):
        raise BadRequest(
            f"temperature must be 0 (greedy) or in {MIN_TEMPERATURE}..{MAX_TEMPERATURE}"
        )
    if not _number(top_p) or not 0 < top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]")
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:
        raise BadRequest(f"seed must be an integer in 0..{MAX_SEED}")
    return float(temperature), float(top_p), seed


class Verifier:
    """The target model and what every session shares (model weights are read-only)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 8,
        batch_cache_tokens: int = 0,
        serve_stats: bool = False,
    ) -> None:
        """`model`: a Hugging Face causal LM (has `.config` and `.generate`). `max_batch`: most
        sessions one forward serves (`spec.max_batch`; 1: each session's forwards alone).
        `batch_cache_tokens`: most cache positions one batched forward holds, padding included
        (`spec.batch_cache_tokens`; 0: auto, `batching.cache_budget`). `serve_stats`: answer
        STATS (`spec.serve_stats`)."""
        self.model = model
        self.serve_stats = serve_stats
        self.max_tokens = session_cap(model.config)
        budget = cache_budget(batch_cache_tokens, max_batch=max_batch, session_cap=self.max_tokens)
        self.batched = BatchedTarget(
            model,
            max_batch=max_batch,
            max_cache_tokens=budget,
            pad_token_id=tokenizer.pad_token_id,
        )
        if max_batch > 1:
            log.info(
                "batched forwards hold at most %d cache positions, padding included (%.1f MiB "
                "of keys and values for this target; spec.batch_cache_tokens)",
                budget,
                budget * cache_bytes_per_token(model) / 2**20,
            )
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.vocab_hash = vocab_hash(tokenizer)
        self.sessions_opened = 0
        self.active_sessions = 0
        self.branches_taken = 0
        """Branches that sessions went on along (all sessions)."""
        self._lock = threading.Lock()

    def handle(self, conn: Connection) -> None:
        """A netproto session handler: serve one drafter until it closes."""
        with self._lock:
            self.sessions_opened += 1
            self.active_sessions += 1
            self.batched.sessions = self.active_sessions
        session: _Session | None = None
        try:
            while True:
                if session is not None and session.has_work():
                    # pipelined: take in whatever has arrived, then check it in one forward
                    started = time.perf_counter()
                    while session is not None and conn.readable():
                        session = self._next(conn, session, waited=False)
                    if session is None or not session.has_work():
                        continue
                    if session.can_decode_alone():
                        # nothing drafted on this prefix: a draft on its way is worth a short
                        # wait (checking it costs no more than decoding), else go on alone
                        wait_s = session.patience_s()
                        if wait_s > 0 and conn.readable(wait_s):
                            continue
                        conn.send_msg(SpecMsg.PROGRESS, session.decode_alone())  # waits not counted
                        continue
                    progress = session.step(started)
                    if progress is not None:
                        conn.send_msg(SpecMsg.PROGRESS, progress)
                    continue
                # idle: a message that is already here came while we computed
                waited = not conn.readable()
                if waited and session is not None:  # on the wire: the batcher waits not for it
                    self.batched.idle(session.decoder)
                session = self._next(conn, session, waited=waited)
        finally:
            if session is not None:
                self.batched.idle(session.decoder, leaving=True)
            session = None  # the cache goes with the session
            with self._lock:
                self.active_sessions -= 1
                self.batched.sessions = self.active_sessions

    def _next(self, conn: Connection, session: _Session | None, *, waited: bool) -> _Session | None:
        """`_dispatch`, and a session it ends (CLOSE, or an OPEN after it) leaves the batcher."""
        after = self._dispatch(conn, session, waited=waited)
        if session is not None and after is not session:
            self.batched.idle(session.decoder, leaving=True)
        return after

    def _dispatch(
        self, conn: Connection, session: _Session | None, *, waited: bool
    ) -> _Session | None:
        """Handle one message; returns the session as it stands after it.

        `waited`: we were idle, waiting for it, so it arrived just now (not while we computed).
        """
        message = conn.recv(expect=set(SpecMsg) - {SpecMsg.PROGRESS, SpecMsg.VERDICT})
        try:
            if message.type == SpecMsg.OPEN:
                opened = _Session.open(self, message.payload)
                try:
                    conn.send_msg(
                        SpecMsg.OPENED,
                        {
                            "vocab_size": self.vocab_size,
                            "prefill_ms": opened.prefill_ms,
                            "max_tokens": self.max_tokens,
                        },
                        request_id=message.request_id,
                    )
                except BaseException:  # never handed back: the batcher forgets it here
                    self.batched.idle(opened.decoder, leaving=True)
                    raise
                session = opened
            elif message.type == SpecMsg.DRAFT:
                if session is None:
                    raise BadRequest("DRAFT before OPEN: no session")
                conn.send_msg(
                    SpecMsg.VERDICT, session.verify(message.payload), request_id=message.request_id
                )
            elif message.type == SpecMsg.STREAM:
                if session is None:
                    raise BadRequest("STREAM before OPEN: no session")
                session.stream(message.payload, waited=waited)
            elif message.type == SpecMsg.BRANCH:
                if session is None:
                    raise BadRequest("BRANCH before OPEN: no session")
                session.add_branch(message.payload)
            elif message.type == SpecMsg.BASELINE:
                conn.send_msg(
                    SpecMsg.BASELINE_DONE,
                    self.baseline(message.payload),
                    request_id=message.request_id,
                )
            elif message.type == SpecMsg.STATS:
                if not self.serve_stats:  # the counts span every session: not for any peer
                    raise BadRequest("STATS is off on this verifier (spec.serve_stats=false)")
                stats = self.batched.stats.as_dict()
                conn.send_msg(SpecMsg.STATS_DONE, stats, request_id=message.request_id)
            elif message.type == SpecMsg.CLOSE:
                session = None
            else:
                raise BadRequest(f"unexpected message {message.type:#06x}")
        except BadRequest as exc:
            conn.send_error("bad_request", str(exc), request_id=message.request_id)
            raise PeerProtocolError(f"bad request from {conn.peer}: {exc}") from None
        return session

    @torch.inference_mode()  # as our own decoding runs: a like-for-like baseline
    def baseline(self, body: dict[str, Any]) -> dict[str, Any]:
        """Target-only generation with Hugging Face `generate`, timed here (no network)."""
        max_new = body.get("max_new_tokens")
        if type(max_new) is not int or not 1 <= max_new <= MAX_BASELINE_TOKENS:
            raise BadRequest(f"BASELINE needs max_new_tokens in 1..{MAX_BASELINE_TOKENS}")
        prompt = _prompt(body, self, room=max_new)
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
    """One drafter's generation: its committed tokens, KV cache and random stream.

    A session is driven by DRAFT rounds (each answered with a VERDICT) or, pipelined, by STREAM
    messages that `step` checks as they come; it takes whichever the drafter sends first.

    Pipelined, the verifier never waits on the drafter: with no drafted token on its committed
    sequence (after a rejection, before the drafter has heard of it) it decodes the next token
    itself (`decode_alone`), as the target alone would, and tells the drafter. Drafts that
    arrive for positions it has decoded are compared with its tokens: while they agree they
    cost nothing and the ones after them are checked as usual; the first that differs ends
    that epoch's stream (the drafter, told of the verifier's token, knows it too).

    Branches: the drafter may send, for a position its live stream has reached, alternatives
    to its token there (a root and the tokens it drafted after it). When the stream dies at a
    position because the verifier's token there differs from the drafter's, and that token is
    a branch's root, the verifier checks on along the branch (its own forward passes, the
    first with the root) instead of decoding alone until the drafter has heard. What it
    commits is its own choice at every position either way: branches change what is checked
    in one forward, never which token a position gets (greedy, or the position's coupled draw).
    """

    def __init__(
        self,
        verifier: Verifier,
        prompt: list[int],
        temperature: float,
        top_p: float,
        seed: int,
        *,
        planned: int = 1,
        alone: bool = True,
    ) -> None:
        self.verifier = verifier
        self.decoder = CachedDecoder(verifier.model, prompt, batched=verifier.batched)
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.prompt_len = len(prompt)
        self.planned = planned
        """Tokens the drafter asked for: the verifier decodes alone up to there, no further."""
        self.alone = alone
        started = time.perf_counter()
        self.decoder.prefill()
        self.prefill_ms = (time.perf_counter() - started) * 1e3
        self.pipelined: bool | None = None
        """Unknown until the first DRAFT (rounds) or STREAM (pipelined)."""
        self.epoch = -1
        """The drafter's stream being checked (it starts a new one whenever it rewinds)."""
        self.dead = False
        """The current epoch's stream has gone wrong: the rest of it is dropped unread."""
        self.pending: list[int] = []
        """Streamed tokens of this epoch not checked yet, in order, from position `pending_at`."""
        self.pending_at = len(prompt)
        self._arrived: list[float | None] = []
        """When each pending token arrived, where known."""
        self._next_logits: torch.Tensor | None = None
        """(V,) the target's logits after the committed sequence, once computed."""
        self._forward: tuple[int, float] = (0, 0.0)
        """The last forward that computed a prediction alone: (tokens fed, ms)."""
        self._more = 1
        """What the drafter said with its last token: how many more it may send before it
        needs word from the verifier (0: it waits for this session's next PROGRESS)."""
        self._step_s = 0.0
        """Running mean of one forward pass of one token, here (what decoding alone costs)."""
        self.branches: dict[int, dict[int, list[int]]] = {}
        """The live stream's branches: position -> root token -> the tokens drafted after it."""
        self.branch: list[int] = []
        """A branch being checked: its tokens not checked yet, from the committed end on."""
        self.branches_taken = 0
        """Branches the verifier went on along (for tests and the curious)."""
        self._diverged: tuple[int, int, int] | None = None
        """(epoch, position, token): where the current epoch's stream died, and the token the
        verifier committed there; a branch rooted at it that arrives later is still taken."""

    @classmethod
    def open(cls, verifier: Verifier, body: dict[str, Any]) -> _Session:
        if body.get("vocab_hash") != verifier.vocab_hash:
            raise BadRequest(
                "the draft model's tokenizer differs from the target's; "
                "speculative decoding needs both to share one vocabulary"
            )
        planned = body.get("max_new_tokens", 1)  # optional: lets a too long plan fail at once
        if type(planned) is not int or not 1 <= planned <= verifier.max_tokens:
            raise BadRequest(f"max_new_tokens must be an int in 1..{verifier.max_tokens}")
        prompt = _prompt(body, verifier, room=planned)
        pipeline, alone = body.get("pipeline", False), body.get("decode_alone", True)
        drafting = body.get("drafting", True)  # false: the target alone, decoding every token
        if not all(isinstance(flag, bool) for flag in (pipeline, alone, drafting)):
            raise BadRequest("pipeline, decode_alone and drafting must be true or false")
        if not drafting and not (pipeline and alone):
            raise BadRequest("drafting=false needs pipeline and decode_alone: who else decodes?")
        hold_ms = body.get("batch_hold_ms", 0)  # optional: the session's consent to be held
        if not _number(hold_ms) or not 0 <= hold_ms <= MAX_BATCH_HOLD_MS:
            raise BadRequest(f"batch_hold_ms must be a number in 0..{MAX_BATCH_HOLD_MS}")
        started = time.perf_counter()
        session = cls(verifier, prompt, *_sampling_params(body), planned=planned, alone=alone)
        verifier.batched.hold(session.decoder, hold_ms / 1e3)
        session._more = int(drafting)  # no draft coming: decode alone without waiting for one
        if pipeline:  # the prediction after the prompt is held before OPENED goes out, so
            session._set_mode(pipelined=True)  # the first token is always checked for free
            try:
                session.step()
            except BaseException:  # the batcher forgets a session that never opened
                verifier.batched.idle(session.decoder, leaving=True)
                raise
            # OPENED's `prefill_ms` is all the target's time on OPEN, that forward too: the
            # drafter takes the rest of OPEN's round trip for the link's (a forward left out
            # read as ~9 ms of link at loopback, and made `gamma=auto` wait for drafts)
            session.prefill_ms = (time.perf_counter() - started) * 1e3
        return session

    def _set_mode(self, pipelined: bool) -> None:
        if self.pipelined is None:
            self.pipelined = pipelined
        elif self.pipelined != pipelined:
            raise BadRequest("a session takes DRAFT rounds or a STREAM, not both")

    def _draft_tokens(self, payload: dict[str, torch.Tensor], what: str) -> list[int]:
        tokens = payload.get("tokens")
        if tokens is None or tokens.dim() != 1 or tokens.dtype != torch.int32:
            raise BadRequest(f"{what} needs an int32 vector `tokens`")
        if tokens.numel() > MAX_GAMMA:
            raise BadRequest(f"a draft holds at most {MAX_GAMMA} tokens")
        return _check_tokens(tokens.tolist(), self.verifier.vocab_size, what)

    def _draft_q(self, payload: dict[str, torch.Tensor], draft: list[int]) -> torch.Tensor | None:
        """The drafter's distributions for its tokens, dense or sparse (spec_decoding.draft_q):
        (k, V) rows of probabilities, each giving its own drafted token a positive one."""
        if self.temperature == 0:
            return None
        if not draft:  # an empty draft (one token left): the verifier samples it alone
            return torch.empty(0, self.verifier.vocab_size)
        try:
            return decode_q(payload, draft, self.verifier.vocab_size)
        except BadDraftQ as exc:
            raise BadRequest(str(exc)) from None

    def _check_room(self, end: int) -> None:
        """A session spans at most the target's context (and MAX_SESSION_TOKENS): `end`, the
        sequence's length with what is asked."""
        if end > self.verifier.max_tokens:
            raise BadRequest(
                f"this session has reached its cap of {self.verifier.max_tokens} tokens"
            )

    def _verdict(
        self, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None
    ) -> tuple[int, int]:
        """`logits`: the target's rows before each drafted token and after the last."""
        if self.temperature == 0:
            return greedy_verdict(logits, draft)
        assert q is not None
        # the rule runs on the CPU: q arrived there, the generator is a CPU one, and its steps
        # are sequential scalar reads (on a GPU, each would be a sync)
        return speculative_verdict(self._probs(logits), q, draft, generator=self.generator)

    def verify(self, payload: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One DRAFT round: check it whole, answer with the accepted count and the next token."""
        self._set_mode(pipelined=False)
        draft = self._draft_tokens(payload, "DRAFT")
        q = self._draft_q(payload, draft)
        self._check_room(len(self.decoder.tokens) + len(draft) + 1)  # and the bonus token
        started = time.perf_counter()
        logits = self.decoder.extend(draft)[-(len(draft) + 1) :]  # (k + 1, V)
        accepted, token = self._verdict(logits, draft, q)
        self.decoder.commit([*draft[:accepted], token])
        return {
            "accepted": accepted,
            "token": token,
            "verify_ms": (time.perf_counter() - started) * 1e3,
        }

    # -- pipelined ---------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, position: int) -> int:
        """The target's token at `position` from its logits there (V,): greedy, or its
        Gumbel-max draw with the position's noise (spec_decoding.sampling.coupled_token)."""
        if self.temperature == 0:
            return int(logits.argmax())
        p = self._probs(logits)
        return coupled_token(p, position_noise(self.seed, position, p.numel()))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's p from its logits, on the CPU (where q and the noise are)."""
        return probs_from_logits(
            logits.float().cpu(), temperature=self.temperature, top_p=self.top_p
        )

    def stream(self, payload: dict[str, torch.Tensor], *, waited: bool = True) -> None:
        """Queue streamed tokens for `step`; drop them if their epoch has gone wrong.

        `waited`: they arrived while the verifier was idle, so it knows when they arrived.
        """
        self._set_mode(pipelined=True)
        epoch, at, more = payload.get("epoch"), payload.get("at"), payload.get("more")
        for name, value in (("epoch", epoch), ("at", at), ("more", more)):
            if value is None or value.numel() != 1 or value.dtype != torch.int64:
                raise BadRequest(f"STREAM needs an int64 `{name}`")
        if not 0 <= int(more) <= MAX_GAMMA:  # type: ignore[arg-type]
            raise BadRequest(f"STREAM's `more` must be in 0..{MAX_GAMMA}")
        if set(payload) - STREAM_FIELDS:
            raise BadRequest(
                f"STREAM holds {sorted(set(payload) - STREAM_FIELDS)}: pipelined sampling is "
                "coupled by position, no q travels"
            )
        tokens = self._draft_tokens(payload, "STREAM")
        epoch_, place = int(epoch), int(at)  # type: ignore[arg-type]
        position = self.prompt_len + place
        committed = len(self.decoder.tokens)
        if epoch_ < self.epoch:
            return  # drafted on a prefix the drafter has since given up
        now = time.perf_counter()
        if epoch_ > self.epoch:  # the drafter rewound to what it knows is committed
            self.branches, self._diverged = {}, None  # (a branch held stays: it is committed)
            if not self.prompt_len <= position <= committed:
                raise BadRequest(
                    f"STREAM of epoch {epoch_} starts at token {place}, outside the 0.."
                    f"{committed - self.prompt_len} this session has committed"
                )
            self.epoch, self.dead, self.pending_at = epoch_, False, position
            self.pending, self._arrived = [], []
        elif self.dead:
            return
        elif position != self.pending_at + len(self.pending):
            raise BadRequest(
                f"STREAM at token {place}: epoch {epoch_}'s stream goes on at "
                f"{self.pending_at + len(self.pending) - self.prompt_len}"
            )
        self._check_room(max(committed, position + len(tokens)))
        if len(self.pending) + len(tokens) > MAX_GAMMA:
            raise BadRequest(f"more than {MAX_GAMMA} streamed tokens waiting to be checked")
        self._more = int(more)  # type: ignore[arg-type]
        self.pending.extend(tokens)
        self._arrived.extend([now if waited else None] * len(tokens))
        self._catch_up()

    def _catch_up(self) -> None:
        """Compare pending tokens at positions already committed (decoded alone) with what
        was committed there: agreeing ones are done with, the first that differs ends the
        epoch's stream (everything after it was drafted on the wrong token)."""
        tokens = self.decoder.tokens
        while self.pending and self.pending_at < len(tokens):
            if self.pending[0] != tokens[self.pending_at]:
                self._stream_died(self.pending_at, tokens[self.pending_at])
                return
            del self.pending[0], self._arrived[0]
            self.pending_at += 1

    def _done(self) -> bool:
        generated = self.decoder.tokens[self.prompt_len :]
        eos = self.verifier.eos_token_id
        return len(generated) >= self.planned or (eos is not None and eos in generated)

    def has_work(self) -> bool:
        """Pipelined: tokens to check, the committed sequence's next prediction to compute, or
        a token to decode alone."""
        if not self.pipelined:
            return False
        if self.pending or self.branch:
            return True
        return (self._next_logits is None and not self._done()) or self.can_decode_alone()

    def can_decode_alone(self) -> bool:
        """Nothing to check and the next prediction held: the next token is the verifier's
        to decide alone (unless the drafter said not to, or the text is done)."""
        return (
            self.alone
            and not self.pending
            and not self.branch
            and self._next_logits is not None
            and not self._done()
        )

    def patience_s(self) -> float:
        """How long to wait for a draft before decoding alone. None while the stream is dead
        (the drafter needs a round trip to hear of it) or the drafter said its last token was
        the last it may send before hearing from the verifier; else, since it is drafting the
        next one now, up to half a forward pass here (at most 5 ms): checking a draft that is
        about to arrive costs less than decoding the token alone."""
        if self.dead or not self._more:
            return 0.0
        return min(self._step_s / 2, 0.005)

    def decode_alone(self, started: float | None = None) -> dict[str, Any]:
        """Commit the target's own next token (its prediction is held: no forward here; the
        next `step` computes the one after it). The PROGRESS that tells the drafter."""
        started = time.perf_counter() if started is None else started
        assert self._next_logits is not None
        at = len(self.decoder.tokens)
        token = self._choose(self._next_logits, at)
        self.decoder.commit([token])
        self._next_logits = None
        self._catch_up()  # (nothing pending: the epoch stays as it is)
        fed, forward_ms = self._forward  # the forward that computed the prediction used
        self._forward = (0, 0.0)
        return {
            "epoch": self.epoch,
            "at": at - self.prompt_len,
            "accepted": 0,
            "tokens": [token],
            "alone": True,
            "fed": fed,
            "verify_ms": forward_ms + (time.perf_counter() - started) * 1e3,
        }

    def step(self, started: float | None = None) -> dict[str, Any] | None:
        """Check the pending tokens with at most one forward pass; the PROGRESS to send.

        The first pending token is checked against the prediction already held, without a
        forward: a wrong first guess costs the target nothing. Without pending tokens (just
        after a rejection or a token decoded alone) the step computes the prediction after the
        committed sequence, so the next first guess is checked at once.
        `started`: when the verifier began taking in the messages this step checks, so that
        `verify_ms` counts their handling too.
        """
        started = time.perf_counter() if started is None else started
        on_branch = bool(self.branch)  # an adopted branch goes first: it was there first
        batch = (self.branch if on_branch else self.pending)[:MAX_GAMMA]
        at = len(self.decoder.tokens)  # == pending_at (or a branch's start): caught up
        fed, accepted, token = 0, 0, None
        if self._next_logits is not None and batch:  # check the first token for free
            choice = self._choose(self._next_logits, at)
            accepted, token = (1, None) if choice == batch[0] else (0, choice)
        if not batch and self._next_logits is not None:
            return None
        if token is None:
            # feeds the committed token the cache lacks (after a rejection) and the batch
            rest = batch[accepted:]
            forward_started = time.perf_counter()
            logits = self.decoder.extend(batch)
            fed = logits.size(0)
            if fed == 1:
                took = time.perf_counter() - forward_started
                self._step_s = took if not self._step_s else 0.8 * self._step_s + 0.2 * took
            rows = logits[-(len(rest) + 1) :]
            for i, drafted in enumerate(rest):
                choice = self._choose(rows[i], at + accepted)
                if choice != drafted:
                    token = choice
                    break
                accepted += 1
            self._next_logits = rows[-1] if token is None else None
        if not batch:  # only computed the prediction after the committed sequence
            self._forward = (fed, (time.perf_counter() - started) * 1e3)
            return None
        if on_branch:
            return self._with_forward_before(
                self._branch_checked(batch, at, accepted, token, fed, started)
            )
        arrived = self._arrived[min(accepted, len(batch) - 1)]  # the last token checked
        progress: dict[str, Any] = {
            "epoch": self.epoch,
            "at": at - self.prompt_len,
            "accepted": accepted,
            "tokens": [],
            "fed": fed,
        }
        if token is None:
            self.decoder.commit(batch, cache_last=True)
            del self.pending[: len(batch)], self._arrived[: len(batch)]
            self.pending_at += len(batch)
        else:
            self.decoder.commit([*batch[:accepted], token])
            self._next_logits = None
            self._stream_died(at + accepted, token)
            progress["tokens"] = [token]
        now = time.perf_counter()
        progress["verify_ms"] = (now - started) * 1e3
        if arrived is not None:
            progress["held_ms"] = (now - arrived) * 1e3
        return self._with_forward_before(progress)

    def _with_forward_before(self, progress: dict[str, Any]) -> dict[str, Any]:
        """A forward that only computed the prediction after the committed tokens (after a
        correction, before drafts arrived) goes out with the next PROGRESS, as `forward_before`
        [tokens fed, ms]: the drafter's cost model sees one-token forwards too (without them it
        fitted the verifier's step at 13 ms where the forward of one token takes 9)."""
        fed, forward_ms = self._forward
        if fed:
            progress["forward_before"] = [fed, forward_ms]
            self._forward = (0, 0.0)
        return progress

    # -- branches ----------------------------------------------------------------------------

    def add_branch(self, payload: dict[str, torch.Tensor]) -> None:
        """Hold a branch of the live stream, or take it at once if the stream died at its
        root's position on its root; drop it if it came too late to be of use."""
        self._set_mode(pipelined=True)
        if set(payload) - BRANCH_FIELDS:
            raise BadRequest(f"BRANCH holds {sorted(set(payload) - BRANCH_FIELDS)}")
        epoch, at = payload.get("epoch"), payload.get("at")
        for name, value in (("epoch", epoch), ("at", at)):
            if value is None or value.numel() != 1 or value.dtype != torch.int64:
                raise BadRequest(f"BRANCH needs an int64 `{name}`")
        tokens = self._draft_tokens(payload, "BRANCH")
        if not 1 <= len(tokens) <= MAX_BRANCH_DEPTH:
            raise BadRequest(f"a branch holds 1..{MAX_BRANCH_DEPTH} tokens, its root included")
        epoch_, position = int(epoch), self.prompt_len + int(at)  # type: ignore[arg-type]
        if epoch_ > self.epoch:
            raise BadRequest(f"BRANCH of epoch {epoch_} before any STREAM of it")
        stream_end = self.pending_at + len(self.pending)
        if not self.prompt_len <= position:
            raise BadRequest(f"BRANCH at token {int(at)}: before the first generated token")  # type: ignore[arg-type]
        self._check_room(position + len(tokens))
        if epoch_ < self.epoch:
            return  # its stream is given up
        root, rest = tokens[0], tokens[1:]
        if self._diverged == (epoch_, position, root):
            self._adopt(rest, position + 1)
            return
        if self.dead or position < self.pending_at:
            return  # the stream died elsewhere, or this position is checked already
        if position >= stream_end:
            raise BadRequest(f"BRANCH at token {int(at)}: the stream has not reached it")  # type: ignore[arg-type]
        if root == self.pending[position - self.pending_at]:
            return  # the stream's own token there
        for old in [p for p in self.branches if p < self.pending_at]:
            del self.branches[old]
        roots = self.branches.setdefault(position, {})
        if root not in roots and len(roots) >= MAX_BRANCH_WIDTH:
            raise BadRequest(f"more than {MAX_BRANCH_WIDTH} branches at token {int(at)}")  # type: ignore[arg-type]
        roots[root] = rest

    def _stream_died(self, position: int, token: int) -> None:
        """The epoch's stream went wrong at `position`, where the verifier committed `token`:
        drop the rest of it, and go on along a branch rooted at `token` there if one is held."""
        held = self.branches.get(position, {}).get(token)
        self.dead, self.pending, self._arrived, self.branches = True, [], [], {}
        self._diverged = (self.epoch, position, token)
        if held is not None:
            self._adopt(held, position + 1)

    def _adopt(self, tokens: list[int], at: int) -> None:
        """Check `tokens` (drafted for positions `at`...) as a branch: those at positions the
        verifier has committed since are compared with its tokens (a difference: the branch
        is of no use), the rest are checked as a stream's would be."""
        self._diverged = None
        committed = self.decoder.tokens
        skip = 0
        while skip < len(tokens) and at + skip < len(committed):
            if tokens[skip] != committed[at + skip]:
                return
            skip += 1
        self.branch = tokens[skip:]
        if self.branch:  # (all of it decided already: nothing taken)
            self.branches_taken += 1
            with self.verifier._lock:
                self.verifier.branches_taken += 1

    def _branch_checked(
        self,
        batch: list[int],
        at: int,
        accepted: int,
        token: int | None,
        fed: int,
        started: float,
    ) -> dict[str, Any]:
        """Commit what `step` found of a branch's tokens; the PROGRESS that says so. The
        tokens are the verifier's own to the drafter (`branch` of them checked drafts, then
        the correction if one was wrong): its stream since may or may not hold them."""
        if token is None:
            self.decoder.commit(batch, cache_last=True)
            del self.branch[: len(batch)]
            own = list(batch)
        else:
            self.decoder.commit([*batch[:accepted], token])
            self._next_logits = None
            self.branch = []
            own = [*batch[:accepted], token]
        self._catch_up()  # a newer stream's tokens for these positions
        return {
            "epoch": self.epoch,
            "at": at - self.prompt_len,
            "accepted": 0,
            "tokens": own,
            "branch": accepted,
            "fed": fed,
            "verify_ms": (time.perf_counter() - started) * 1e3,
        }
