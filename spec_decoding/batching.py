"""One target forward for several sessions: the verifier batching its drafters.

Each session keeps its own KV cache (`CachedDecoder`) and asks for forwards as before; the
sessions' threads meet here. Whoever asks while no forward runs leads: it takes the requests
waiting (the oldest first, the others as they fit), runs them as one padded batch, hands each
its logits and its grown cache, and leads again while its own waits; the others sleep until
theirs is done. A batch is what arrived while the last forward ran (continuous batching), and
the sessions in flight: those a forward served that are not back yet with their next request
(doing their bookkeeping, a moment behind) and have not said they wait on the wire (`idle`).
The leader waits for those at most a share of a forward's time (GATHER_SHARE), and not for a
session whose own turnaround runs past that, nor, until its next forward, for one it waited
for in vain: a slow session costs its own forwards. One session alone never waits.

The batch: past caches left-padded to the longest, new tokens right-padded to the longest, an
attention mask that hides both paddings and each row's own position ids, so every row sees
its own prefix only. Afterwards each row's cache is cut back out (its padding dropped): a
session that leaves takes its cache with it, one that joins brings its own.

Memory admission: every row of a batch is padded to its longest past, so one long session
would make each forward it joins hold (rows x its length) cache positions. A batch takes a
waiting request only while rows x (longest past + longest new) stays within the budget
(`spec.batch_cache_tokens`): a long session runs in a smaller batch, or alone, and costs its
own forwards, not everyone's. The oldest waiting request always goes first, so none starves.

Holding for a batch (`spec.batch_hold_ms`, a session's own choice at OPEN): sessions that each
come back from a round trip (DRAFT rounds across a link) reach the verifier one at a time, and
each forward then pays its base and, after the verifier idled, its cold start alone. A session
that consents to be held up to h seconds lets the leader wait, from its request's arrival, for
the other sessions that consented to come with theirs (until all are queued, or the batch is
full; a connection with nothing coming, or a session that asked for no hold, is not waited for); the
wait ends at once when a request that consents to no hold, or a shorter one, is queued: it
holds only the sessions that asked for it. Sessions served together get their verdicts
together and so come back close together: after the first hold they stay batched, and a wait
is the spread of their drafting and link, not h. The leader waits only for the sessions due
back within the hold (each session's cycle, result to next request, learnt as it goes; one
overdue or not yet measured is waited for too, but once a hold has waited for it in vain, not
again until it is back): a session a moment too late for one forward runs right after it
and is waited for the next round, where a hold for everyone that consented kept it apart
(each side held h for the other, in vain, both shifted alike: on the lab's box, 4 drafters
at 50 ms one-way ran as a stable 3 + 1 or 2 + 2, 1.7-1.9 sessions a forward, 2.9 after
this). Where a consenting session is due within half a cycle after the hold, the leader
holds its whole consent anyway, so two groups further apart than h close in by h a round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

if TYPE_CHECKING:
    from spec_decoding.cache import CachedDecoder

log = logging.getLogger(__name__)

MAX_PADDING_SHARE = 0.5
"""A batch takes waiting requests, shortest first, while at most this share of its token slots
is padding (a 33-token check next to three 2-token ones would pay 4 x 33): the rest wait for
the next forward, the oldest always in the first. (A prompt's prefill runs alone, in its
session's thread: `CachedDecoder.prefill`.)"""
GATHER_SHARE = 1.0
MAX_GATHER_S = 0.005
"""A leader waits for the sessions in flight at most this share of a one-session forward's
time (its running mean; and at most this long). In flight: served by a forward and not back
with their next request, nor gone to wait on the wire (`idle`): they are usually a moment
behind, doing their sessions' bookkeeping. A session that misses the batch runs a forward of
its own after it, and forwards run one at a time, so a wait up to that forward's time costs
the batch no more than the late session would have; it costs no CPU. Without a wait one of
them started a forward alone each time while the rest queued behind it (batches of 1 and 3 in
turn for 4 sessions); waiting a quarter of the last forward for as many as it served kept a
batch that had once run short short."""
TURNAROUND_WEIGHT = 0.2
"""Weight of the newest sample in a session's running mean turnaround (from its forward's
result to its next request): a session whose turnaround runs past the leader's wait is not
waited for, so a slow session costs its own forwards, not everyone's."""
ROW_CACHE_TOKENS = 2048
"""`spec.batch_cache_tokens=0` (auto) lets a batch hold `max_batch` rows of this many cache
positions (or of the session cap, if shorter): sessions up to that long batch whole, and a
forward's cache stays bounded whatever the model's context (one session at a cap of 8192 shares
a forward with one other at most, instead of padding `max_batch` rows to 8192)."""


def cache_budget(configured: int, *, max_batch: int, session_cap: int) -> int:
    """The most cache positions one batched forward may hold: `configured`
    (`spec.batch_cache_tokens`), or with 0 `max_batch` rows of min(session_cap,
    ROW_CACHE_TOKENS)."""
    if configured < 0:
        raise ValueError(f"spec.batch_cache_tokens={configured} must be >= 0 (0: auto)")
    return configured or max_batch * min(session_cap, ROW_CACHE_TOKENS)


def cache_bytes_per_token(model: Any) -> int:
    """Bytes one cache position takes in `model` (keys and values, every layer), from its
    config's shape and its dtype; 0 where the config does not say."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    )
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int)):
        return 0
    itemsize = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * itemsize  # keys and values


@dataclass
class _Request:
    decoder: CachedDecoder
    feed: list[int]
    arrived: float = 0.0
    """When it was queued (the batcher's clock)."""
    hold_s: float = 0.0
    """How long its session consents to wait, from `arrived`, for other sessions to batch with."""
    done: threading.Event = field(default_factory=threading.Event)
    logits: torch.Tensor | None = None
    error: BaseException | None = None

    @property
    def drafted(self) -> int:
        """Tokens fed beyond the decoder's committed sequence (its drafts being checked)."""
        decoder = self.decoder
        return max(0, len(self.feed) - max(0, len(decoder.tokens) - len(decoder.cached)))


@dataclass
class _Away:
    """A session between its forward's result and its next request, as the batcher sees it."""

    returned_at: float | None = None
    """When its last forward handed it its logits; None: back since, or waiting on the wire."""
    awaited: bool = False
    """A leader may wait for it: in flight, and not missed by a wait since its forward."""
    turnaround_s: float | None = None
    """Running mean of its result-to-next-request time (None: not measured yet)."""
    served_at: float | None = None
    """When its last forward handed it its logits (kept while it waits on the wire)."""
    cycle_s: float | None = None
    """Running mean of its result-to-next-request time however it spent it (its drafting
    and the wire's round trip included): when a held leader expects it back (`_hold`)."""
    hold_missed: bool = False
    """A hold waited for it in vain (stalled, or opened and silent): no hold waits for it
    again until it is back with a request."""

    def expected(self) -> float | None:
        """When its next request should come (None: not known yet)."""
        if self.served_at is None or self.cycle_s is None:
            return None
        return self.served_at + self.cycle_s


@dataclass
class BatchStats:
    """What the batcher did, for tests, the bench and /health."""

    forwards: int = 0
    rows: int = 0
    """Session-forwards served (a forward of 3 sessions counts 3)."""
    tokens: int = 0
    """Tokens fed, padding excluded."""
    most_rows: int = 0
    most_cache_tokens: int = 0
    """The most cache positions one forward held, padding included: rows x (longest past +
    longest new). Within the budget for every forward of several rows (a session alone holds
    its own, whatever its length)."""
    deferred: int = 0
    """Times a waiting request was left for a later forward because it would have taken the
    batch over the cache budget."""
    padding_refused: int = 0
    """Times a waiting request was left for a later forward because it would have made more
    than MAX_PADDING_SHARE of the batch's token slots padding."""
    failed_rows: int = 0
    """Rows whose forward failed alone (their session ends; the others' went on)."""
    drafted: int = 0
    """Tokens fed beyond each session's committed sequence (drafts checked), padding excluded."""
    slots: int = 0
    """Token slots the forwards computed, padding included (rows x the longest feed each)."""
    by_rows: dict[int, int] = field(default_factory=dict)
    """Forwards by their rows: {sessions in the forward: forwards}."""
    gather_waits: int = 0
    """Forwards whose leader waited for sessions in flight."""
    gather_missed: int = 0
    """Sessions waited for that had not come when the wait ended (not waited for again
    until their next forward)."""
    turnarounds: int = 0
    turnaround_s: float = 0.0
    """Sessions back with a request after their forward (not via the wire), and their time
    from result to request in all."""
    hold_waits: int = 0
    held_s: float = 0.0
    """Forwards whose leader held for sessions that consented (`hold`), and their waits in all."""
    drift_holds: int = 0
    """Of those, the holds for nobody due within them, to drift towards a session due soon
    after (`BatchedTarget._hold`)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the verifier's STATS_DONE)."""
        figures: dict[str, Any] = {k: v for k, v in vars(self).items() if k != "by_rows"}
        figures["by_rows"] = {str(rows): n for rows, n in sorted(self.by_rows.items())}
        return figures


class BatchedTarget:
    """The target model shared by every session of a verifier; forwards batched across them."""

    def __init__(
        self,
        model: Any,
        *,
        max_batch: int = 8,
        max_cache_tokens: int | None = None,
        pad_token_id: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_cache_tokens`: the most cache positions, padding included, one forward of
        several sessions may hold (`cache_budget`; None: no bound). `clock`: what the gather
        reads (tests inject one)."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be at least 1")
        if max_cache_tokens is not None and max_cache_tokens < 1:
            raise ValueError(f"max_cache_tokens={max_cache_tokens} must be at least 1")
        self.model = model
        self.device = next(model.parameters()).device
        self.max_batch = max_batch
        self.max_cache_tokens = max_cache_tokens
        self.pad_token_id = pad_token_id or 0  # any id: its rows' outputs are dropped
        self.stats = BatchStats()
        self._queue: list[_Request] = []
        self._leading = False
        self._sessions = 0
        self._last_forward_s = 0.0
        self._one_row_s = 0.0
        """Running mean of a one-session forward's time (wall clock, the leader's)."""
        self._away: dict[int, _Away] = {}
        """Per session (its decoder's id) served so far: whether it is in flight."""
        self._holds: dict[int, float] = {}
        """Per session (its decoder's id) that consented: how long it may be held (`hold`)."""
        self._clock = clock
        self._cond = threading.Condition()

    @property
    def sessions(self) -> int:
        """Sessions open on the verifier (it counts them): a leader waits for no more."""
        return self._sessions

    @sessions.setter
    def sessions(self, count: int) -> None:
        with self._cond:
            self._sessions = count
            self._cond.notify_all()  # a leader gathering for sessions that have left stops

    def run(self, decoder: CachedDecoder, feed: list[int]) -> torch.Tensor:
        """Feed `feed` after `decoder`'s cache; (len(feed), V) float logits. The decoder's
        cache has grown by `feed` when this returns. Blocks while other sessions' forwards
        run; raises what its own forward raised, never another's."""
        with self._cond:
            hold_s = self._holds.get(id(decoder), 0.0)
            request = _Request(decoder, list(feed), arrived=self._clock(), hold_s=hold_s)
            self._back(decoder)
            self._queue.append(request)
            self._cond.notify_all()  # a leader gathering a batch counts it
            while not request.done.is_set():
                if self._leading:
                    self._cond.wait()
                    continue
                self._leading = True
                self._gather()
                self._hold()
                batch = self._take()
                self._cond.release()
                try:
                    self._serve(batch)
                finally:
                    self._cond.acquire()
                    self._leading = False
                    self._cond.notify_all()
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def hold(self, decoder: CachedDecoder, hold_s: float) -> None:
        """`decoder`'s session consents to wait up to `hold_s` seconds for other sessions to
        share its forwards (0: never held; it leaves with `idle(leaving=True)`)."""
        if not 0.0 <= hold_s < float("inf"):
            raise ValueError(f"a hold must be a finite number of seconds >= 0, not {hold_s}")
        with self._cond:
            if hold_s:
                self._holds[id(decoder)] = hold_s
            else:
                self._holds.pop(id(decoder), None)
            self._cond.notify_all()  # a leader holding for it (withdrawn) stops

    def idle(self, decoder: CachedDecoder, *, leaving: bool = False) -> None:
        """`decoder`'s session waits on the wire (or, `leaving`, has ended): no leader waits
        for its next request."""
        with self._cond:
            if leaving:
                self._away.pop(id(decoder), None)
                self._holds.pop(id(decoder), None)
            elif id(decoder) in self._away:
                away = self._away[id(decoder)]
                away.returned_at, away.awaited = None, False
            self._cond.notify_all()  # a leader waiting for it stops

    def _back(self, decoder: CachedDecoder) -> None:
        """(The lock held.) `decoder`'s session is back with a request: its turnaround."""
        away = self._away.get(id(decoder))
        if away is not None:
            away.hold_missed = False
            if away.served_at is not None:  # its cycle, wire or not
                cycle = max(0.0, self._clock() - away.served_at)
                mean = away.cycle_s
                if mean is not None:  # one long pause moves it at most to 1.2x, not for rounds
                    cycle = min(cycle, 2 * mean)
                away.cycle_s = cycle if mean is None else mean + TURNAROUND_WEIGHT * (cycle - mean)
        if away is None or away.returned_at is None:
            return
        took = max(0.0, self._clock() - away.returned_at)
        self.stats.turnarounds += 1
        self.stats.turnaround_s += took
        mean = away.turnaround_s
        away.turnaround_s = took if mean is None else mean + TURNAROUND_WEIGHT * (took - mean)
        away.returned_at, away.awaited = None, False

    def _in_flight(self, deadline: float) -> list[_Away]:
        """(The lock held.) Sessions in flight that should be back by `deadline`."""
        return [
            away
            for away in self._away.values()
            if away.awaited
            and away.returned_at is not None
            and away.returned_at + (away.turnaround_s or 0.0) <= deadline
        ]

    def _gather(self) -> None:
        """(The lock held, leading.) Wait a moment for the sessions in flight (GATHER_SHARE):
        each that has not come by the end is not waited for again until its next forward."""
        wait_s = min(GATHER_SHARE * (self._one_row_s or self._last_forward_s), MAX_GATHER_S)
        deadline = self._clock() + wait_s
        room = min(self.sessions, self.max_batch) - len(self._queue)
        awaited = self._in_flight(deadline)
        if not awaited or room <= 0 or wait_s <= 0:
            return
        self.stats.gather_waits += 1
        while True:
            awaited = [a for a in awaited if a.awaited]
            if not awaited or len(self._queue) >= min(self.sessions, self.max_batch):
                return
            left = deadline - self._clock()
            if left <= 0:
                break
            self._cond.wait(left)
        for away in awaited:  # (its turnaround is still measured when it comes)
            away.awaited = False
            self.stats.gather_missed += 1

    def _hold(self) -> None:
        """(The lock held, leading.) While every queued request consents to a hold, wait for
        the requests of the other sessions that consented too and are due (`_awaited`: a
        connection that has no request coming, a session that asked for no hold, one due
        only after the hold, or one a hold waited for in vain since its last request, is not
        waited for): until those are queued or the batch is full, or the shortest consent
        (from each request's arrival) runs out; a request queued meanwhile with a shorter
        one, or none, shortens or ends the wait; a session that leaves is no longer waited
        for. Where none is due within it but one is due within half a cycle after it (its
        own or the queued sessions', the shorter), the queued ones are held their whole
        consent anyway (`drift_holds`): they come back that much closer to it, and two groups
        that came apart (one a moment too late for a forward) meet again within a few rounds
        instead of each holding for the other, in vain, every round."""
        due: list[int] = []
        started, held, drift, ran_out = self._clock(), False, False, False
        while self._queue and len(self._queue) < self.max_batch:
            deadline = min(r.arrived + r.hold_s for r in self._queue)
            due, drift = self._awaited(deadline)
            if deadline <= self._clock():
                ran_out = all(r.hold_s > 0 for r in self._queue)  # (not ended by a refusal)
                break
            if not (due or drift):
                break
            held = True
            self._cond.wait(deadline - self._clock())
        for key in due if held and ran_out else ():  # the consent ran out before they came:
            self._away.setdefault(key, _Away()).hold_missed = True  # not waited for till back
        if held:
            self.stats.hold_waits += 1
            self.stats.held_s += self._clock() - started
            self.stats.drift_holds += int(drift and not due)

    def _awaited(self, deadline: float) -> tuple[list[int], bool]:
        """(The lock held.) For a leader holding until `deadline`: the consenting sessions
        not queued that it waits for (due by the deadline, or overdue, or with no cycle
        measured yet; not one a hold waited for in vain since its last request), and whether,
        none of them, one is due within half a cycle after the deadline (held anyway, to
        drift towards it; the cycle its own or the queued sessions' shortest, whichever is
        shorter: a slow session does not hold a fast group half of its long cycle)."""
        queued = {id(r.decoder) for r in self._queue}
        cycles = [a.cycle_s for r in self._queue if (a := self._away.get(id(r.decoder)))]
        mine = min((c for c in cycles if c is not None), default=float("inf"))
        due, drift = [], False
        for key in self._holds:
            away = self._away.get(key)
            if key in queued or (away is not None and away.hold_missed):
                continue
            expected = away.expected() if away is not None else None
            if expected is None or expected <= deadline:
                due.append(key)
                continue
            assert away is not None and away.cycle_s is not None
            drift = drift or expected - deadline < min(away.cycle_s, mine) / 2
        return due, drift

    def _take(self) -> list[_Request]:
        """The next batch (the lock held): the oldest waiting request, then the others with
        the shortest feeds, within `max_batch`, `MAX_PADDING_SHARE` and the cache budget. The
        oldest always goes, however long its cache: a request waits at most as many forwards
        as there were requests before it (one per other session), so none starves."""
        head, *others = self._queue  # in arrival order
        batch = [head]
        for request in sorted(others, key=lambda r: len(r.feed)):
            if len(batch) == self.max_batch:
                break
            rows = [*batch, request]
            longest = max(len(r.feed) for r in rows)
            real = sum(len(r.feed) for r in rows)
            if (longest * len(rows) - real) > MAX_PADDING_SHARE * longest * len(rows):
                self.stats.padding_refused += 1
                continue
            budget = self.max_cache_tokens
            if budget is not None and padded_cache_tokens(rows) > budget:
                self.stats.deferred += 1
                continue
            batch.append(request)
        for request in batch:
            self._queue.remove(request)
        return batch

    def _serve(self, batch: list[_Request]) -> None:
        """Run one batch; a batch that fails is run again row by row, so a row that fails
        alone fails only its own session."""
        started = time.perf_counter()
        drafted = sum(r.drafted for r in batch)  # (before the forward grows the caches)
        try:
            outputs = self.forward([(r.decoder, r.feed) for r in batch])
            self._last_forward_s = took = time.perf_counter() - started
            if len(batch) == 1:
                mean = self._one_row_s
                self._one_row_s = took if not mean else mean + TURNAROUND_WEIGHT * (took - mean)
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error = exc
                self.stats.failed_rows += 1
                batch[0].done.set()
                return
            log.warning("a batched forward of %d sessions failed: each runs alone", len(batch))
            for request in batch:
                self._serve([request])
            return
        self.stats.drafted += drafted
        with self._cond:
            returned = self._clock()
            for request, logits in zip(batch, outputs, strict=True):
                away = self._away.setdefault(id(request.decoder), _Away())
                away.returned_at, away.awaited = returned, True
                away.served_at = returned
                request.logits = logits
                request.done.set()

    @torch.inference_mode()
    def forward(self, jobs: list[tuple[CachedDecoder, list[int]]]) -> list[torch.Tensor]:
        """One forward over `jobs` (decoder, tokens to feed after its cache): each decoder's
        cache grown by its tokens, and its (len(feed), V) float logits."""
        if len(jobs) == 1:  # alone: exactly the unbatched forward
            decoder, feed = jobs[0]
            input_ids = torch.tensor([feed], dtype=torch.long, device=self.device)  # (1, T)
            out = self.model(input_ids=input_ids, past_key_values=decoder.cache, use_cache=True)
            decoder.cache = out.past_key_values
            self._count([len(feed)], cache_tokens=len(decoder.cached) + len(feed))
            return [out.logits[0].float()]
        past = [len(d.cached) for d, _ in jobs]
        fed = [len(f) for _, f in jobs]
        longest_past, longest_feed = max(past), max(fed)
        width = longest_past + longest_feed
        input_ids = torch.full((len(jobs), longest_feed), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(jobs), width, dtype=torch.long)  # (B, past + new)
        positions = torch.zeros(len(jobs), longest_feed, dtype=torch.long)  # (B, new)
        for row, ((_, feed), length) in enumerate(zip(jobs, past, strict=True)):
            input_ids[row, : len(feed)] = torch.tensor(feed)
            mask[row, longest_past - length : longest_past + len(feed)] = 1
            positions[row] = torch.arange(length, length + longest_feed)
        cache = _padded_cache([d.cache for d, _ in jobs], past, longest_past)
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits.float()  # (B, new, V)
        rows = [  # every row's cache built before any session takes its own: a failure here
            _row_cache(out.past_key_values, row, longest_past - length, longest_past + len(feed))
            for row, ((_, feed), length) in enumerate(zip(jobs, past, strict=True))
        ]  # (out of memory) leaves every cache as it was, and the rows rerun alone
        for (decoder, _), own in zip(jobs, rows, strict=True):
            decoder.cache = own
        self._count(fed, cache_tokens=len(jobs) * width)
        return [logits[row, : len(feed)] for row, (_, feed) in enumerate(jobs)]

    def _count(self, fed: list[int], *, cache_tokens: int) -> None:
        stats = self.stats
        stats.forwards += 1
        stats.rows += len(fed)
        stats.tokens += sum(fed)
        stats.slots += len(fed) * max(fed, default=0)
        stats.most_rows = max(stats.most_rows, len(fed))
        stats.by_rows[len(fed)] = stats.by_rows.get(len(fed), 0) + 1
        stats.most_cache_tokens = max(stats.most_cache_tokens, cache_tokens)


def padded_cache_tokens(rows: list[_Request]) -> int:
    """Cache positions a forward of `rows` holds, padding included (`forward` pads every past
    to the longest and every feed to the longest)."""
    longest_past = max(len(r.decoder.cached) for r in rows)
    return len(rows) * (longest_past + max(len(r.feed) for r in rows))


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """A DynamicCache's (keys, values) per layer, each (1, heads, length, head_dim); None
    while it holds nothing."""
    layers = getattr(cache, "layers", None) or []
    pairs = [(layer.keys, layer.values) for layer in layers if layer.keys is not None]
    if not pairs or pairs[0][0].numel() == 0:
        return None
    return pairs


def _padded_cache(caches: list[Any], past: list[int], longest: int) -> DynamicCache:
    """The sessions' caches as one, each row left-padded with zeros to `longest` tokens."""
    per_session = [_layers(c) for c in caches]
    template = next((p for p in per_session if p is not None), None)
    batched = DynamicCache()
    if template is None or longest == 0:
        return batched
    for index, (keys, values) in enumerate(template):
        heads, dim = keys.shape[1], keys.shape[-1]
        shape = (len(caches), heads, longest, dim)  # (B, heads, past, head_dim)
        all_keys = keys.new_zeros(shape)
        all_values = values.new_zeros((len(caches), values.shape[1], longest, values.shape[-1]))
        for row, (layers, length) in enumerate(zip(per_session, past, strict=True)):
            if layers is None or length == 0:
                continue
            all_keys[row, :, longest - length :] = layers[index][0][0]
            all_values[row, :, longest - length :] = layers[index][1][0]
        batched.update(all_keys, all_values, index)
    return batched


def _row_cache(cache: Any, row: int, start: int, end: int) -> DynamicCache:
    """Row `row` of a batched cache, positions start..end (its padding cut), as its own."""
    own = DynamicCache()
    for index, layer in enumerate(cache.layers):
        keys = layer.keys[row : row + 1, :, start:end].clone()  # (1, heads, length, head_dim)
        values = layer.values[row : row + 1, :, start:end].clone()
        own.update(keys, values, index)
    return own
