"""The drafter: runs the small model next to the user and asks the verifier to check drafts."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.cli import UserError
from lab.sampling import probs_from_logits
from netproto import Connection, ConnectionClosed, NetTimeout, PeerProtocolError
from spec_decoding.cache import CachedDecoder
from spec_decoding.config import MAX_BRANCH_DEPTH, MAX_GAMMA, SpecConfig
from spec_decoding.draft_q import as_probabilities, encode_q, quantize
from spec_decoding.gamma import GammaController
from spec_decoding.protocol import SpecMsg
from spec_decoding.sampling import coupled_token, position_noise
from spec_decoding.verifier import vocab_hash


class VerifierLostError(UserError, RuntimeError):
    """The verifier went away (or stopped answering) while we needed it."""


@dataclass
class RoundStats:
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    round_s: float


@dataclass
class CheckStats:
    """One PROGRESS of a pipelined generation: the verifier's word on what it had received."""

    accepted: int
    """Drafted tokens it found right: accepted ones, and one the verifier decoded alone that
    equals the drafter's."""
    rejected: bool
    """A drafted token found wrong: a correction, or a token decoded alone that differs."""
    rewound: bool
    """The drafter's stream ended: a token found wrong, or a token decoded alone where the
    drafter had drafted none yet."""
    alone: bool
    """The verifier decoded the token itself (it had no draft for that position)."""
    branch: int
    """Tokens it committed along one of our branches (drafts of a branch it checked)."""
    fed: int
    """Tokens the verifier's forward pass ran (0: the first guess failed, no forward needed)."""
    verify_s: float
    rtt_s: float | None
    """Round trip of the last token checked, less the time it waited at the verifier; None
    when the verdict arrived while the drafter was busy drafting (its arrival time unknown)."""
    window: int
    forward_before: tuple[int, float] | None = None
    """A forward the verifier ran before this verdict's own that only computed its next
    prediction: (tokens fed, seconds)."""
    root_hit: bool | None = None
    """A token of ours found wrong where we held branch roots: whether one was the
    verifier's token (None: no wrong token with roots)."""


@dataclass
class Generation:
    """One prompt's speculative generation and how it went."""

    tokens: list[int]
    seconds: float
    rounds: list[RoundStats] = field(default_factory=list)
    """DRAFT rounds (`pipeline=False`)."""
    checks: list[CheckStats] = field(default_factory=list)
    """PROGRESS messages (`pipeline=True`)."""
    decode_alone: bool = False
    """Pipelined: the verifier was to decode alone whenever it had no draft."""
    drafted: int = 0
    alone: int = 0
    """Pipelined: tokens the verifier decoded by itself (no draft had reached it)."""
    branches: int = 0
    branch_s: float = 0.0
    """Pipelined: branches drafted and sent, and the drafter's seconds spent on them."""
    branch_tokens: int = 0
    """Pipelined: drafted tokens the verifier accepted along a branch."""
    branch_depth: int = 0
    """Pipelined: the depth of its branches at the end (0: none)."""
    roots: bool = False
    """Pipelined: its drafted tokens were given next-best roots (branches configured)."""
    flat: int = 0
    """Of its drafted tokens, those unsure enough to branch (`branch_flatness`)."""
    draft_s: float = 0.0
    """Pipelined: tokens drafted (kept or not) and the drafter's seconds spent on them."""
    sent_bytes: int = 0
    """Bytes of the DRAFT or STREAM frames that carried the drafted tokens (headers included)."""
    q_bytes: int = 0
    """Of those, the bytes of the q entries' elements (sampling only)."""
    prefill_ms: float = 0.0
    open_rtt_s: float | None = None
    """OPEN's round trip less the verifier's time on it; None where it could not be dated (a
    pipelined drafter found OPENED already there at its first look, after its own prefill; in
    rounds, OPENED comes back with the first DRAFT's verdict)."""
    open_s: float = 0.0
    """Setting up: the drafter's own prefill (the first drafts follow OPEN without waiting for
    OPENED: in rounds, the first round's trip carries OPEN's too)."""


@dataclass
class _Flight:
    """A pipelined generation's tokens: confirmed, and sent but not yet confirmed.

    `epoch` numbers the drafter's streams: each runs on from a prefix the verifier committed
    and ends when the drafter learns that one of its tokens is not what the verifier chose."""

    confirmed: list[int]
    inflight: list[int] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    others: list[list[int]] = field(default_factory=list)
    """Per token in flight: its next-best tokens, best first (branch roots)."""
    alternatives: list[list[int]] = field(default_factory=list)
    """Per token in flight: those of its next-best tokens not yet drafted into a branch."""
    epoch: int = 0

    def drop(self, count: int) -> None:
        """The first `count` tokens in flight are settled."""
        del self.inflight[:count], self.sent_at[:count]
        del self.others[:count], self.alternatives[:count]

    def finished(self, max_new_tokens: int, eos_token_id: int | None) -> bool:
        return len(self.confirmed) >= max_new_tokens or (
            eos_token_id is not None and eos_token_id in self.confirmed
        )


class Drafter:
    """Speculative generation against a remote verifier, one session per `generate` call."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        conn: Connection,
        *,
        gamma: GammaController,
        temperature: float = 0.0,
        top_p: float = 1.0,
        draft_top_k: int = 0,
        pipeline: bool = False,
        decode_alone: bool = True,
        branch_depth: int = 0,
        branch_width: int = 1,
        branch_flatness: float = 0.0,
        batch_hold_ms: float = 0.0,
    ) -> None:
        """`model`: a Hugging Face causal LM. `pipeline`: keep drafting while the verifier
        checks (STREAM); else DRAFT rounds. `draft_top_k` (sampling): draft only from the k
        likeliest tokens (0: all within top_p), so fewer q entries travel per token.
        `decode_alone` (pipelined): the verifier decodes by itself whenever it holds no draft
        for its next token, instead of waiting for one. `branch_depth` (pipelined): while it
        waits, draft branches of that many tokens rooted at the `branch_width` next-best tokens
        of positions in flight (0: none); `branch_flatness`: only at positions where the
        next-best token is at least that likely next to the drafted one (p2 / p1; 0: all).
        `batch_hold_ms`: the verifier may hold our forwards this long for other sessions to
        share them (`spec.batch_hold_ms`; 0: never)."""
        if draft_top_k < 0:
            raise ValueError(f"draft_top_k={draft_top_k} must be >= 0 (0: off)")
        if (
            not 0 <= branch_depth <= MAX_BRANCH_DEPTH
            or branch_width < 1
            or not 0 <= branch_flatness <= 1
        ):
            raise ValueError(
                f"branch_depth={branch_depth} must be in 0..{MAX_BRANCH_DEPTH}, "
                f"branch_width={branch_width} at least 1, branch_flatness={branch_flatness} "
                "in 0..1"
            )
        self.batch_hold_ms = batch_hold_ms
        self.model = model
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.pipeline = pipeline
        self.decode_alone = decode_alone
        self.branch_depth = branch_depth if pipeline else 0
        self.branch_width = branch_width
        self.branch_flatness = branch_flatness
        gamma.branch_depth = self.branch_depth
        gamma.pipelined = pipeline  # the window model or the rounds model picks gamma
        gamma.alone = pipeline and decode_alone
        self.conn = conn
        self.gamma = gamma
        self.temperature = temperature
        self.top_p = top_p
        self.draft_top_k = draft_top_k
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_hash = vocab_hash(tokenizer)
        self.tokenizer_size = len(tokenizer)

    @contextlib.contextmanager
    def _verifier_lost(self) -> Iterator[None]:
        """Turns the connection failing into VerifierLostError, naming the verifier."""
        try:
            yield
        except (ConnectionClosed, NetTimeout, PeerProtocolError) as exc:
            raise VerifierLostError(f"lost the verifier at {self.conn.peer}: {exc}") from None

    def _request(self, msg_type: int, payload: Any, *, expect: int) -> dict[str, Any]:
        with self._verifier_lost():
            return self.conn.request(msg_type, payload, expect=expect).payload

    def _draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q (V,) from the draft's logits, on the CPU whatever the model's device: it is sent
        (rounds) or meets noise drawn there (pipelined), and a seed draws the same anywhere."""
        return probs_from_logits(
            logits.float().cpu(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.draft_top_k,
        )

    def _pick(
        self, logits: torch.Tensor, generator: torch.Generator
    ) -> tuple[int, torch.Tensor | None]:
        """The draft's token from its logits (V,); with sampling, also the integer weights of
        the distribution it was drawn from (spec_decoding.draft_q), which is what is sent."""
        if self.temperature == 0:
            return int(logits.argmax()), None
        # (V,): the drafter samples from exactly what it sends
        weights = quantize(self._draft_probs(logits)[None])[0]
        token = torch.multinomial(as_probabilities(weights), 1, generator=generator).item()
        return int(token), weights

    def _propose(
        self, decoder: CachedDecoder, gamma: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """Draft `gamma` tokens autoregressively; with sampling, also their q weights."""
        draft: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(gamma):
            token, q = self._pick(decoder.extend(draft[-1:])[-1], generator)
            draft.append(token)
            if q is not None:
                rows.append(q)
        return draft, (torch.stack(rows) if rows else None)  # q weights: (gamma, V)

    def generate(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        seed: int = 0,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """`on_tokens` sees the tokens the verifier has confirmed so far, as they come (past
        an end-of-text or max_new_tokens at times: the result is cut there). What it raises
        ends the generation mid-session and propagates: close the connection then (the verifier
        frees the session), for a stale verdict may still be on its way."""
        self.on_tokens = on_tokens or (lambda tokens: None)
        if type(max_new_tokens) is not int or max_new_tokens < 1:
            # (pipelined, OPEN goes out unanswered: the verifier's refusal would only surface
            # as a broken connection at the next generation)
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: at least 1")
        started = time.perf_counter()
        self.gamma.new_text()
        if self.pipeline:
            result = self._generate_pipelined(prompt, max_new_tokens=max_new_tokens, seed=seed)
        else:
            result = self._generate_rounds(prompt, max_new_tokens=max_new_tokens, seed=seed)
        self.conn.send(SpecMsg.CLOSE)
        if self.pipeline:  # choose the next window now, not while a stream waits on us (the
            self.gamma.new_text()  # next text's acceptance prior, as `generate` starts it)
            self.gamma.rechoose()
        result.tokens = result.tokens[:max_new_tokens]
        result.seconds = time.perf_counter() - started
        return result

    def _open(
        self, prompt: list[int], seed: int, max_new_tokens: int
    ) -> tuple[CachedDecoder, Generation]:
        """OPEN the session and prefill the draft. Neither mode waits for OPENED: the first
        drafts follow OPEN on the wire (a round trip less per generation: 100 ms at 50 ms one
        way), and `_opened` takes OPENED in before the first verdict (rounds) or among the
        verdicts (pipelined). In rounds this also keeps a client's next generation in step
        with the sessions it was batched with (`spec.batch_hold_ms`): its first DRAFT comes
        when its next round's would have."""
        started = time.perf_counter()
        body = {
            "prompt": prompt,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": seed,
            "vocab_hash": self.vocab_hash,
            "pipeline": self.pipeline,
            "decode_alone": self.decode_alone,
            "max_new_tokens": max_new_tokens,
        }
        if self.batch_hold_ms:  # (a verifier before the hold knows no such field)
            body["batch_hold_ms"] = self.batch_hold_ms
        result = Generation(tokens=[], seconds=0.0)
        self._open_sent = started
        # until OPENED says the target's: ids past the shared tokenizer are no tokens
        self.target_vocab = min(self.vocab_size, self.tokenizer_size)
        with self._verifier_lost():
            self.conn.send_msg(SpecMsg.OPEN, body)
        decoder = CachedDecoder(self.model, prompt)
        decoder.prefill()
        result.open_s = time.perf_counter() - started
        return decoder, result

    def _opened(self, opened: dict[str, Any], result: Generation, *, dated: bool = True) -> None:
        """OPENED's figures: the verifier's time on OPEN, its vocabulary, the round trip (where
        `dated`: OPENED is taken in as it arrives)."""
        if not isinstance(opened, dict):
            raise ValueError(f"verifier sent OPENED {type(opened).__name__}, not an object")
        prefill_ms: Any = opened.get("prefill_ms")
        vocab_size: Any = opened.get("vocab_size")
        if not _milliseconds(prefill_ms):
            raise ValueError(f"verifier sent prefill_ms={prefill_ms!r}")
        if type(vocab_size) is not int or not 1 <= vocab_size <= 2**31:
            raise ValueError(f"verifier sent vocab_size={vocab_size!r}")
        result.prefill_ms = float(prefill_ms)
        self.target_vocab = vocab_size
        elapsed = time.perf_counter() - self._open_sent
        result.open_rtt_s = max(0.0, elapsed - result.prefill_ms / 1e3) if dated else None

    def _generate_rounds(self, prompt: list[int], *, max_new_tokens: int, seed: int) -> Generation:
        decoder, result = self._open(prompt, seed, max_new_tokens)
        generator = torch.Generator().manual_seed(seed + 1)
        while len(result.tokens) < max_new_tokens:
            round_started = time.perf_counter()
            gamma = min(self.gamma.next_gamma(), max_new_tokens - len(result.tokens) - 1)
            draft, q = self._propose(decoder, gamma, generator) if gamma > 0 else ([], None)
            drafted_at = time.perf_counter()
            payload = {"tokens": torch.tensor(draft, dtype=torch.int32)}
            if q is not None:
                result.q_bytes += _add_q(payload, q)
            sent_before = self.conn.bytes_sent
            first = not result.rounds
            opening_s = 0.0
            with self._verifier_lost():
                request_id = self.conn.next_request_id()
                self.conn.send(SpecMsg.DRAFT, payload, request_id=request_id)
                if first:  # OPEN's answer comes first (an OPEN refused raises its reason)
                    self._opened(self.conn.recv(expect=SpecMsg.OPENED).payload, result, dated=False)
                    opening_s = max(0.0, result.prefill_ms / 1e3 - (drafted_at - self._open_sent))
                reply = self.conn.recv(expect=SpecMsg.VERDICT)
                if reply.request_id != request_id:  # as conn.request fails: the link is done
                    self.conn.close()
                    raise PeerProtocolError(
                        f"verifier answered DRAFT {request_id} as {reply.request_id}"
                    )
            verdict = reply.payload
            result.sent_bytes += self.conn.bytes_sent - sent_before
            accepted, token = int(verdict["accepted"]), self._token(verdict["token"])
            if not 0 <= accepted <= len(draft):
                raise ValueError(f"verifier accepted {accepted} of {len(draft)} drafted tokens")
            new = [*draft[:accepted], token]
            decoder.commit(new)
            stats = RoundStats(
                drafted=len(draft),
                accepted=accepted,
                draft_s=drafted_at - round_started,
                verify_s=float(verdict["verify_ms"]) / 1e3,
                # the first round's trip carried OPEN too: what of the verifier's time on it the
                # DRAFT waited for (OPEN went out before our prefill and drafting) is not link
                round_s=time.perf_counter() - round_started - opening_s,
            )
            result.rounds.append(stats)
            self.gamma.update(
                drafted=stats.drafted,
                accepted=stats.accepted,
                draft_s=stats.draft_s,
                verify_s=stats.verify_s,
                round_s=stats.round_s,
            )
            if self.eos_token_id is not None and self.eos_token_id in new:
                result.tokens.extend(new[: new.index(self.eos_token_id) + 1])
                self.on_tokens(result.tokens)
                break
            result.tokens.extend(new)
            self.on_tokens(result.tokens)
        return result

    def _generate_pipelined(
        self, prompt: list[int], *, max_new_tokens: int, seed: int
    ) -> Generation:
        """Draft without waiting: stream each token, take in verdicts between steps.

        `flight.inflight` holds the tokens sent in this epoch and not yet confirmed; the decoder
        follows prompt + confirmed + inflight. When the verifier commits a token that is not
        the drafter's (a correction, or one it decoded alone), the decoder rewinds to the
        confirmed tokens and the next epoch starts there.
        """
        decoder, result = self._open(prompt, seed, max_new_tokens)
        flight = _Flight(confirmed=result.tokens)
        result.decode_alone = self.decode_alone
        result.roots = bool(self.branch_depth)
        window = self.gamma.next_gamma()
        busy_since = time.perf_counter()  # the drafter's own time, waits excluded
        looked = False  # whether we have looked for news and found none since OPEN went out
        opened = False
        while not flight.finished(max_new_tokens, self.eos_token_id):
            may_draft = (
                len(flight.inflight) < window
                and len(flight.confirmed) + len(flight.inflight) < max_new_tokens
                and not (flight.inflight and flight.inflight[-1] == self.eos_token_id)
            )
            branch = self._branch_choice(flight) if self.branch_depth else None
            if branch is not None and not self.conn.readable():
                branch_started = time.perf_counter()
                result.sent_bytes += self._send_branch(
                    decoder, flight, *branch, len(prompt), seed, max_new_tokens
                )
                busy_since = time.perf_counter()  # no drafting time
                result.branches += 1
                result.branch_s += busy_since - branch_started
                continue
            if not may_draft or self.conn.readable():
                # a verdict we wait for dates its round trip; one found between steps does not
                waited = not may_draft and not self.conn.readable()
                kind, progress = self._request_progress()
                received = time.perf_counter()
                if kind == SpecMsg.OPENED:  # behind which our first drafts went
                    if opened:
                        raise ValueError("verifier sent OPENED twice in one session")
                    opened = True
                    # dated if it came while we waited, or since a look that found nothing
                    # (within one draft step); at the first look it may have waited out our
                    # whole prefill, and would read as link time
                    self._opened(progress, result, dated=waited or looked)
                    if result.open_rtt_s is not None:
                        self.gamma.observe_rtt(result.open_rtt_s)  # until cleaner samples
                    if waited:  # the wait is no drafting time
                        busy_since = received
                    window = self.gamma.next_gamma()
                    continue
                if waited:
                    busy_since = received
                stats = self._take_progress(progress, flight, received, waited, window)
                self.on_tokens(flight.confirmed)
                result.checks.append(stats)
                result.alone += 1 if stats.alone else 0
                result.branch_tokens += stats.branch
                if stats.rewound:
                    decoder.rewind([*prompt, *flight.confirmed])
                window = self.gamma.next_gamma()
                continue
            looked = True  # nothing had come
            # The token at a position is drawn with that position's noise, as the verifier's
            # is: how far the drafter runs ahead cannot change what it drafts.
            token, alternatives = self._guess(
                decoder.extend([])[-1],
                seed,
                len(decoder.tokens),
                others=self.branch_width if self.branch_depth else 0,
            )
            decoder.commit([token])
            at = len(flight.confirmed) + len(flight.inflight)  # its place among the new tokens
            # how many more it may send before it needs the verifier's word: with none, the
            # verifier knows not to wait for a next draft
            more = min(window - len(flight.inflight) - 1, max_new_tokens - at - 1)
            more = 0 if token == self.eos_token_id else more
            payload = {
                "tokens": torch.tensor([token], dtype=torch.int32),
                "epoch": torch.tensor([flight.epoch], dtype=torch.int64),
                "at": torch.tensor([at], dtype=torch.int64),
                "more": torch.tensor([max(0, min(more, MAX_GAMMA))], dtype=torch.int64),
            }
            with self._verifier_lost():
                result.sent_bytes += self.conn.send(SpecMsg.STREAM, payload)
            flight.inflight.append(token)
            flight.others.append(alternatives)
            flight.alternatives.append(list(alternatives))
            if self.branch_depth:  # how many of our tokens are unsure enough to branch
                result.flat += bool(alternatives)
                self.gamma.observe_flat(bool(alternatives))
            now = time.perf_counter()
            flight.sent_at.append(now)
            # a step's cost includes taking in the verdicts that came since the last one
            step_s, busy_since = now - busy_since, now
            result.drafted += 1
            result.draft_s += step_s
            self.gamma.observe_draft(step_s)
        result.branch_depth = self.gamma.branch_plan() if self.branch_depth else 0
        if self.eos_token_id is not None and self.eos_token_id in flight.confirmed:
            del flight.confirmed[flight.confirmed.index(self.eos_token_id) + 1 :]
        return result

    def _guess(
        self, logits: torch.Tensor, seed: int, position: int, *, others: int = 0
    ) -> tuple[int, list[int]]:
        """The drafter's guess at the verifier's token at `position` from its logits (V,):
        greedy, or the Gumbel-max draw from q with the position's noise, which is the
        verifier's draw whenever q and p agree (spec_decoding.sampling.coupled_token); and up
        to `others` next-best guesses (by logit, or by log q + noise), each a possible token,
        where the best of them is at least `branch_flatness` as likely as the guess (none
        where the draft is surer)."""
        vocab = self.target_vocab  # a token past the target's vocabulary is no guess
        if self.temperature == 0:
            scores = logits[:vocab].float()
            token = int(scores.argmax())
        else:
            q = self._draft_probs(logits)  # the noise is drawn over the target's vocabulary
            if q.numel() >= vocab:
                q = q[:vocab]
            else:
                q = torch.nn.functional.pad(q, (0, vocab - q.numel()))
            noise = position_noise(seed, position, vocab)  # (drawn once: V draws and logs)
            token = coupled_token(q, noise)
            if not others:
                return token, []
            scores = q.double().log() + noise  # what coupled_token ranks
        if not others:
            return token, []
        best = scores.topk(min(1 + others, scores.numel()))
        gap = float(best.values[1] - best.values[0]) if best.values.numel() > 1 else -math.inf
        if not math.exp(gap) >= self.branch_flatness:  # sure of its token: no branch here
            return token, []
        alternatives = [
            int(i)
            for v, i in zip(best.values, best.indices, strict=True)
            if math.isfinite(v) and int(i) != token
        ]
        return token, alternatives[:others]

    def _branch_choice(self, flight: _Flight) -> tuple[int, int] | None:
        """The newest token in flight, if it has a next-best token not branched yet, and the
        depth to branch it to (gamma.branch_plan); None: no branch now. A token is branched
        as soon as it is sent, so its branches reach the verifier close behind it."""
        depth = self.gamma.branch_plan()
        newest = len(flight.inflight) - 1
        if depth < 2 or newest < 0 or not flight.alternatives[newest]:
            return None
        return newest, depth

    def _send_branch(
        self,
        decoder: CachedDecoder,
        flight: _Flight,
        index: int,
        depth: int,
        prompt_len: int,
        seed: int,
        max_new_tokens: int,
    ) -> int:
        """Draft and send one branch at the `index`-th token in flight: rooted at its best
        next-best token not drafted yet, `depth` tokens in all. The draft's cache forks
        there and comes back (the stream's tokens past it are fed again, in one forward, at
        the next draft step). The bytes sent."""
        root = flight.alternatives[index].pop(0)
        place = len(flight.confirmed) + index  # among the generated tokens
        stream = list(decoder.tokens)
        decoder.rewind([*stream[: prompt_len + place], root])
        tokens = [root]
        while (
            len(tokens) < depth
            and place + len(tokens) < max_new_tokens
            and tokens[-1] != self.eos_token_id
        ):
            token, _ = self._guess(decoder.extend([])[-1], seed, len(decoder.tokens))
            decoder.commit([token])
            tokens.append(token)
        decoder.rewind(stream)
        payload = {
            "tokens": torch.tensor(tokens, dtype=torch.int32),
            "epoch": torch.tensor([flight.epoch], dtype=torch.int64),
            "at": torch.tensor([place], dtype=torch.int64),
        }
        with self._verifier_lost():
            return self.conn.send(SpecMsg.BRANCH, payload)

    def _take_progress(
        self, progress: dict[str, Any], flight: _Flight, received: float, waited: bool, window: int
    ) -> CheckStats:
        """Apply one PROGRESS to the tokens in flight; feed its measurements to `gamma`.

        The verifier committed, from token `at` on: `accepted` of this epoch's drafts, then
        `tokens` of its own choosing (a correction, or tokens it decoded alone)."""
        at, accepted, tokens = progress.get("at"), progress.get("accepted"), progress.get("tokens")
        if at != len(flight.confirmed):
            raise ValueError(
                f"verifier went on from token {at!r}; {len(flight.confirmed)} are confirmed"
            )
        branch = progress.get("branch", 0)
        if not isinstance(tokens, list) or len(tokens) > MAX_BRANCH_DEPTH:
            raise ValueError(f"verifier committed {tokens!r}: too many tokens of its own")
        if type(branch) is not int or not len(tokens) - 1 <= branch <= len(tokens):
            raise ValueError(f"verifier took {branch!r} of {len(tokens)} tokens along a branch")
        limit = len(flight.inflight) if progress.get("epoch") == flight.epoch else 0
        if "branch" in progress or len(tokens) > 1:  # a branch's: none of the stream's
            limit = 0
        if type(accepted) is not int or not 0 <= accepted <= limit or not accepted + len(tokens):
            raise ValueError(
                f"verifier accepted {accepted!r} of {limit} tokens in flight (epoch {flight.epoch})"
            )
        own = [self._token(t) for t in tokens]
        alone = bool(progress.get("alone"))
        checked = accepted + (len(own) if not alone else 0)
        matched = 0  # its tokens that were ours, in flight after the accepted ones
        while (
            matched < len(own)
            and accepted + matched < len(flight.inflight)
            and flight.inflight[accepted + matched] == own[matched]
        ):
            matched += 1
        fed, verify_ms = progress.get("fed"), progress.get("verify_ms", math.nan)
        held_ms = progress.get("held_ms")
        if type(fed) is not int or not 0 <= fed <= MAX_GAMMA + MAX_BRANCH_DEPTH:
            raise ValueError(f"verifier sent fed={fed!r}")
        if not _milliseconds(verify_ms) or (held_ms is not None and not _milliseconds(held_ms)):
            raise ValueError(f"verifier sent verify_ms={verify_ms!r}, held_ms={held_ms!r}")
        if held_ms is not None and not 0 < checked <= len(flight.sent_at):
            # (a token the verifier decided, or a branch's: none of ours was waiting there)
            raise ValueError(f"verifier sent held_ms for {checked} tokens of ours checked")
        stats = CheckStats(
            accepted=accepted + matched,
            rejected=matched < len(own) and accepted + matched < len(flight.inflight),
            rewound=matched < len(own),
            alone=alone,
            branch=branch if "branch" in progress else 0,
            fed=fed,
            verify_s=float(verify_ms) / 1e3,
            rtt_s=max(0.0, received - flight.sent_at[checked - 1] - float(held_ms) / 1e3)
            if waited and held_ms is not None
            else None,
            window=window,
        )
        wrong = accepted + matched  # (where a token in flight was found wrong)
        others = flight.others[wrong] if stats.rejected and wrong < len(flight.others) else []
        if others:  # how often a branch's root would have been the verifier's token
            stats.root_hit = own[matched] in others
            self.gamma.observe_root(stats.root_hit)
        elif stats.rejected and self.branch_depth:  # wrong where the draft was sure
            self.gamma.observe_root(None)
        if stats.accepted or stats.rejected:
            self.gamma.observe_checks(accepted=stats.accepted, rejected=stats.rejected)
        if stats.fed:
            self.gamma.observe_verify(stats.fed, stats.verify_s)
        before = progress.get("forward_before")
        if before is not None:
            if (
                not isinstance(before, list)
                or len(before) != 2
                or type(before[0]) is not int
                or not 1 <= before[0] <= MAX_GAMMA + 1
                or not _milliseconds(before[1])
            ):
                raise ValueError(f"verifier sent forward_before={before!r}")
            stats.forward_before = (before[0], float(before[1]) / 1e3)
            self.gamma.observe_verify(*stats.forward_before)
        if stats.rtt_s is not None:
            self.gamma.observe_rtt(stats.rtt_s)
        flight.confirmed.extend(flight.inflight[:accepted])
        flight.confirmed.extend(own)
        if matched == len(own):  # its tokens were ours: the stream goes on
            flight.drop(accepted + matched)
        else:
            flight.drop(len(flight.inflight))
            flight.epoch += 1
        return stats

    def _token(self, value: Any) -> int:
        """A token id from the verifier, checked before it reaches the draft model."""
        if not isinstance(value, int) or not 0 <= value < self.vocab_size:
            raise ValueError(f"verifier sent token {value!r}, outside 0..{self.vocab_size - 1}")
        return value

    def _request_progress(self) -> tuple[SpecMsg, dict[str, Any]]:
        """The next PROGRESS, or OPENED at a generation's start: (its type, its payload)."""
        with self._verifier_lost():
            message = self.conn.recv(expect={SpecMsg.PROGRESS, SpecMsg.OPENED})
        return SpecMsg(message.type), message.payload

    def baseline(self, prompt: list[int], *, max_new_tokens: int, seed: int = 0) -> dict[str, Any]:
        """Target-only generation on the verifier (timed there, no network in the figure)."""
        return self._request(
            SpecMsg.BASELINE,
            {
                "prompt": prompt,
                "max_new_tokens": max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": seed,
            },
            expect=SpecMsg.BASELINE_DONE,
        )


def _milliseconds(value: Any) -> bool:
    """A time the verifier reports: a JSON number (not a bool, not a string), finite, in
    0..1e7 ms (a NaN fed to the cost model would leave its simulation running forever)."""
    return type(value) in (int, float) and 0 <= value <= 1e7


def _add_q(payload: dict[str, torch.Tensor], weights: torch.Tensor) -> int:
    """Put q's weights (k, V) into a DRAFT or STREAM payload; the bytes of its elements."""
    entries = encode_q(weights)
    payload.update(entries)
    return sum(t.numel() * t.element_size() for t in entries.values())


def drafter_for(
    model: Any, tokenizer: Any, conn: Connection, spec: SpecConfig, **sampling: Any
) -> Drafter:
    """The drafter `spec.*` describes, on `conn`: the run's drafter role and the serve role
    build it here alike (`sampling`: temperature and top_p, the role's or the request's)."""
    return Drafter(
        model,
        tokenizer,
        conn,
        draft_top_k=spec.draft_top_k,
        pipeline=spec.pipeline,
        decode_alone=spec.decode_alone,
        branch_depth=spec.branch_depth,
        branch_width=spec.branch_width,
        branch_flatness=spec.branch_flatness,
        batch_hold_ms=spec.batch_hold_ms,
        gamma=GammaController(
            fixed=spec.fixed_gamma,
            max_gamma=spec.max_gamma,
            pipelined=spec.pipeline,
            alone=spec.pipeline and spec.decode_alone,
            branch_depth=spec.branch_depth,
        ),
        **sampling,
    )
