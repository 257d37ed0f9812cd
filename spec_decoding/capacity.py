"""A verifier serving several drafters: its capacity as the pipeline model predicts it.

Capacity is tokens delivered per second of the target host's CPU. Across a WAN link one
user's speculative decoding barely beats the target alone ("Speculation at a Distance"): the
gain is the host's, which checks several tokens of each drafter in one forward where the target
alone decodes one token per client per forward. The verifier batches its sessions' forwards
(spec_decoding/batching.py).

The verifier's CPU, term by term, each measured locally (none from the capacity run itself):
  - the shared loop (`LoopCosts`): S sessions decoding in threads through one batcher, as the
    verifier's sessions do, without the link, measured as the process's CPU (every thread:
    the forwards, the batcher's hand-over and wake-ups, each session's argmax, commit and cache
    crop, and its PROGRESS frame encoded and sent over TCP to another process). One forward
    of that loop costs base + per_session x sessions + per_drafted x drafted tokens, fitted
    over a grid of (sessions, drafted tokens a session): the base is paid once a forward
    whatever its rows (the weights read, the batch assembled), so it is shared by the sessions
    in it; each session pays its own row (its committed token, its cache padded in and cut
    back out, its thread's wake-up and bookkeeping, its frame sent) and each drafted token it
    brings. The same loop at S sessions without drafts says how full its forwards run
    (`LoopCosts.fill`: a session a moment behind misses a forward).
  - the rest of each session's frame handling (`FrameCosts`): what a session costs the
    verifier per forward beyond the loop (its drafts' frames received, decoded and validated,
    the verdict's bookkeeping), from one client of the arm's kind alone on the link: the
    verifier's CPU over that run less its forwards' loop cost, per forward.
Before these, the forwards' costs came from forwards timed alone (one thread, in isolation)
and a per-token overhead from one session: the loop's cost at four sessions was under-counted
and both arms were overpredicted about 1.5x.

The sessions: each is `gamma.simulate_pipeline`'s session (its acceptance, draft step and
link) on a verifier whose forward costs the loop's over the sessions and drafted tokens in it
(the other sessions there as often as each is busy at the verifier, times the loop's fill),
found as a fixed point. DRAFT rounds (`spec.pipeline=false`, `predict_rounds`): each session
drafts a window, sends it in one frame and waits a round trip for the verdict, so each forward
of its checks the whole window (Leviathan et al.'s expected tokens a round), and the window is
the one the rounds model of `gamma=auto` picks for that session. A forward of several sessions
pads each row to the longest window in it and computes those slots too: the windows a
session drafted round by round, alone, say how long the longest of n is (`padding_factor`).
With each session consenting to be held for the others (`spec.batch_hold_ms`), who shares a
forward is the batcher's policy, not chance: the run is played out event by event
(`simulate_rounds`) on each prompt's rounds as one session alone ran them, the batcher's
hold rules played as it plays them.
The target alone, batched alike, runs one forward of the sessions' committed tokens per token
of each client.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from spec_decoding.gamma import CostModel, PipelineModel, expected_tokens, simulate_pipeline


@dataclass(frozen=True)
class LoopCosts:
    """CPU seconds of one forward of the shared loop (every thread of the process): `base_s` +
    `per_session_s` x sessions + `per_drafted_s` x drafted tokens in it, fitted
    (`fit`) to that loop measured locally at several (sessions, drafted tokens a session)."""

    base_s: float
    """Once a forward, whatever its rows: the weights read (a CPU forward over a few tokens is
    memory-bound), the batch's mask, positions and padded cache assembled."""
    per_session_s: float
    """Each session in the forward: its committed token's row, its cache padded in and cut back
    out, its thread woken, its argmax, commit and cache crop, its PROGRESS frame sent."""
    per_drafted_s: float
    """Each drafted token checked beyond a session's committed one."""
    sessions: int = 1
    """Sessions the loop ran with when its fill was measured."""
    rows_per_forward: float = 1.0
    """At `sessions` sessions without drafts: the sessions a forward served, on average."""
    cold: tuple[tuple[float, float], ...] = ()
    """(seconds the verifier was idle before a forward, the CPU seconds that forward costs
    beyond one run back to back), measured over a few pauses: a forward after a pause finds
    the weights and the thread's state out of the core's caches (on the lab's 2-core box, one
    after 100 ms of idle cost about twice one run back to back). Empty: not measured (0)."""

    def cold_s(self, idle_s: float) -> float:
        """What a forward that follows `idle_s` seconds of idle costs beyond a hot one:
        interpolated over `cold`, never falling with a longer pause, flat past its last."""
        if not self.cold or idle_s <= 0:
            return 0.0
        gaps = [0.0, *(g for g, _ in self.cold)]
        extra = np.maximum.accumulate([0.0, *(max(e, 0.0) for _, e in self.cold)])
        return float(np.interp(idle_s, gaps, extra))

    def seconds(self, sessions: float, drafted: float = 0.0, idle_s: float = 0.0) -> float:
        """One forward's CPU over `sessions` sessions and `drafted` drafted tokens in all,
        after `idle_s` seconds of the verifier idle."""
        return (
            self.base_s
            + self.cold_s(idle_s)
            + self.per_session_s * max(sessions, 1.0)
            + self.per_drafted_s * drafted
        )

    def session_share_s(self, rows: float, drafted: float = 0.0, idle_s: float = 0.0) -> float:
        """What one session's part of a forward of `rows` sessions costs: its share of the
        base (and of the forward's cold start after `idle_s` idle), its own row and its
        `drafted` tokens."""
        shared = self.base_s + self.cold_s(idle_s)
        return shared / max(rows, 1.0) + self.per_session_s + self.per_drafted_s * drafted

    @property
    def fill(self) -> float:
        """The share of the other waiting sessions a forward finds in it (1: all)."""
        if self.sessions < 2:
            return 1.0
        return min(1.0, max(0.0, (self.rows_per_forward - 1) / (self.sessions - 1)))

    @classmethod
    def fit(
        cls,
        forwards: Iterable[tuple[float, float, float]],
        *,
        sessions: int = 1,
        rows_per_forward: float = 1.0,
        cold: Iterable[tuple[float, float]] = (),
    ) -> LoopCosts:
        """Least squares over (mean sessions a forward, mean drafted tokens a forward, CPU
        seconds a forward) points, no term negative (one that fits negative is dropped and
        the rest refitted; a CPU cost never falls with more work)."""
        points = np.array([p for p in forwards if all(np.isfinite(p))], dtype=float)
        if len(points) == 0:
            raise ValueError("no measurements to fit the loop's costs to")
        columns = {"base": np.ones(len(points)), "session": points[:, 0], "drafted": points[:, 1]}
        for name, column in list(columns.items())[1:]:
            if np.ptp(column) == 0:  # not varied: not measurable apart from the base
                del columns[name]
        while True:
            design = np.column_stack(list(columns.values()))
            coefs = np.linalg.lstsq(design, points[:, 2], rcond=None)[0]
            fitted = dict(zip(columns, coefs.tolist(), strict=True))
            negative = [n for n, c in fitted.items() if c < 0]
            if not negative or len(columns) == 1:
                break
            del columns[min(negative, key=fitted.__getitem__)]
        return cls(
            base_s=max(0.0, fitted.get("base", 0.0)),
            per_session_s=fitted.get("session", 0.0),
            per_drafted_s=fitted.get("drafted", 0.0),
            sessions=sessions,
            rows_per_forward=rows_per_forward,
            cold=tuple(sorted((float(g), float(e)) for g, e in cold)),
        )


@dataclass(frozen=True)
class FrameCosts:
    """The verifier's CPU per forward of one session beyond the loop: the frames it receives
    and the protocol's bookkeeping (`measured` from one client alone on the link)."""

    per_forward_s: float

    @classmethod
    def measured(
        cls,
        *,
        cpu_s: float,
        forwards: Iterable[int],
        loop: LoopCosts,
        wall_s: float = 0.0,
        opened_s: float = 0.0,
    ) -> FrameCosts:
        """From one session's run: the verifier's CPU `cpu_s` less its forwards' loop cost
        (`forwards`: each one's tokens fed, the first its committed token, the rest drafted;
        each after the idle the run's `wall_s` left between them, on average) and, where the
        model prices them apart, its OPENs' prefills (`opened_s`), per forward."""
        fed = list(forwards)
        idle_s = idle_per_forward(wall_s=wall_s, cpu_s=cpu_s, forwards=len(fed))
        looped = sum(loop.seconds(1, max(f - 1, 0)) for f in fed) + len(fed) * loop.cold_s(idle_s)
        return cls(per_forward_s=max(0.0, (cpu_s - looped - opened_s) / max(len(fed), 1)))


def idle_per_forward(*, wall_s: float, cpu_s: float, forwards: int) -> float:
    """The verifier's idle before each forward, on average, over a run of `wall_s` seconds in
    which it spent `cpu_s` of CPU (one thread: busy is CPU) on `forwards` forwards."""
    return max(0.0, wall_s - cpu_s) / max(forwards, 1)


@dataclass
class _SharedVerifier(PipelineModel):
    """A session's view of a batching verifier: its forward over `fed` tokens (the first its
    committed one) takes the loop's forward over it and the others' rows and drafts, and its
    own frames."""

    loop: LoopCosts | None = None
    frames: FrameCosts | None = None
    other_rows: float = 0.0
    other_drafted: float = 0.0
    idle_s: float = 0.0
    """The verifier's idle before a forward, on average (the forward's cold start)."""

    def _verify_s(self, fed: int) -> float:
        assert self.loop is not None and self.frames is not None
        drafted = max(fed - 1, 0) + self.other_drafted
        forward_s = self.loop.seconds(1 + self.other_rows, drafted, self.idle_s)
        return forward_s + self.frames.per_forward_s


@dataclass(frozen=True)
class Prediction:
    tokens_per_cpu_s: float
    """Tokens delivered per second of the verifier's CPU (all its sessions)."""
    per_client_tokens_per_s: float
    """What one client gets: its tokens over its generations' wall time."""
    window: int = 0
    """Speculative: the window `gamma=auto` would choose (0: the target alone)."""
    tokens_per_forward: float = 1.0
    """Of one session, per forward (the target alone: 1)."""
    rows_per_forward: float = 1.0
    """Sessions a forward serves."""
    drafted_per_forward: float = 0.0
    """Drafted tokens a forward checks, all its sessions'."""


def predict_speculative(
    *,
    sessions: int,
    alpha: float,
    draft_s: float,
    one_way_s: float,
    loop: LoopCosts,
    frames: FrameCosts,
    max_window: int,
    max_new_tokens: int,
    alone: bool = False,
    alpha_after_wrong: float | None = None,
    open_s: float = 0.0,
    tokens: int = 400,
) -> Prediction:
    """S closed-loop drafters on one batching verifier. `alone`: it decodes by itself when it
    holds no draft (`spec.decode_alone`); else it waits for drafts, idle. `open_s`: the
    target's time on each generation's OPEN.

    Each session is busy at the verifier a share u of its time (its forwards' seconds over its
    wall time, simulated); a forward finds each other session in it with that chance times the
    loop's fill, so it serves rows = 1 + (S - 1) u fill sessions and their drafted tokens. The
    verifier's CPU per token: over the session's forwards, each its share of the forward's base
    (base / rows), its own row, its drafted tokens and its frames; and, where the verifier
    idles between forwards (the sessions' forwards, S of them over `rows` a forward, leave it
    time), each forward's cold start (`LoopCosts.cold_s`), shared like the base."""
    others, others_drafted, busy, idle_s = 0.0, 0.0, 1.0, 0.0
    for _ in range(12):
        model = _SharedVerifier(
            alpha=min(max(alpha, 0.0), 0.999),
            draft_s=draft_s,
            verify_base_s=loop.base_s + loop.per_session_s + frames.per_forward_s,
            verify_per_token_s=loop.per_drafted_s,
            one_way_s=one_way_s,
            alone=alone,
            alpha_after_wrong=alpha_after_wrong,
            loop=loop,
            frames=frames,
            other_rows=others,
            other_drafted=others_drafted,
            idle_s=idle_s,
        )
        window = model.best_window(max_window)
        fed: list[int] = []
        rates = [
            simulate_pipeline(model, window, alone=alone, tokens=tokens, seed=s, forwards=fed)
            for s in range(2)
        ]
        forward_s = sum(model._verify_s(f) for f in fed)
        wall_s = sum(tokens / rate for rate in rates)
        busy = min(1.0, forward_s / wall_s)
        mean_drafted = statistics.mean(max(f - 1, 0) for f in fed) if fed else 0.0
        target = (sessions - 1) * busy * loop.fill
        rows = 1 + others
        per_s = sessions * len(fed) / wall_s / rows  # the verifier's forwards a second
        busy_s = loop.seconds(rows, rows * mean_drafted) + rows * frames.per_forward_s
        idle_target = max(0.0, 1 / per_s - busy_s) if per_s > 0 else 0.0
        settled = abs(target - others) < 0.01 and abs(idle_target - idle_s) < 1e-4
        others = 0.5 * others + 0.5 * target
        others_drafted = others * mean_drafted
        idle_s = 0.5 * idle_s + 0.5 * idle_target
        if settled:
            break
    rows = 1 + others  # sessions a forward serves
    cpu_s = sum(
        loop.session_share_s(rows, max(f - 1, 0), idle_s) + frames.per_forward_s for f in fed
    )  # the verifier's CPU for this session's forwards; every session alike
    rate = statistics.mean(rates)  # one session's tokens per second of its own wall time
    per_generation = max_new_tokens / rate + 2 * one_way_s + open_s
    return Prediction(
        tokens_per_cpu_s=2 * tokens / cpu_s,
        per_client_tokens_per_s=max_new_tokens / per_generation,
        window=window,
        tokens_per_forward=2 * tokens / max(len(fed), 1),
        rows_per_forward=rows,
        drafted_per_forward=rows * mean_drafted,
    )


def predict_rounds(
    *,
    sessions: int,
    alpha: float,
    draft_s: float,
    one_way_s: float,
    loop: LoopCosts,
    frames: FrameCosts,
    max_window: int,
    max_new_tokens: int,
    open_s: float = 0.0,
    draft_open_s: float = 0.0,
    hold_s: float = 0.0,
    windows: Sequence[int] = (),
    plans: Sequence[Plan] = (),
    generations: int = 4,
) -> Prediction:
    """S closed-loop drafters in DRAFT rounds on one batching verifier. Each round a session
    drafts g tokens (g: what the rounds model of `gamma=auto` picks from the same costs), sends
    them in one DRAFT frame, and the verifier checks them in one forward: expected_tokens(alpha,
    g) tokens for the session's share of that forward's base, its row, its g drafted tokens and
    its frames (`frames`: a round's DRAFT and VERDICT beyond the loop, from one client alone in
    rounds). A session is at the verifier a share u of its round (the forward's time over the
    round's: draft, link both ways, forward); a forward finds each other session in it with
    that chance times the loop's fill, and the verifier idles between forwards what the
    sessions' rounds leave it, each forward paying its cold start (a fixed point, as
    `predict_speculative`). `windows` (a session's drafted tokens round by round, from one
    session alone): a forward of several sessions pads each row to the longest window in it,
    and computes those slots too (`padding_factor`).

    `hold_s` (`spec.batch_hold_ms`, each session's consent to wait for the others): who meets
    in a forward is then the batcher's policy, not chance, and the run is played out event by
    event (`simulate_rounds`) on `plans` (each client's generations' rounds; from one session
    alone, each prompt's rounds as it ran them there; none: `generations` of each client drawn
    from `windows`, or the window above, and `alpha`), the prefill of each generation
    `open_s`. (Before, held rounds were taken to serve all S sessions a forward: measured, a
    session whose windows ran long was refused for padding and drifted apart, a new
    generation's session was unknown to the batcher, the run's tail had clients done, and a
    forward served 2.8-3.0 of 4.)"""
    alpha = min(max(alpha, 0.0), 0.999)
    held = hold_s > 0
    others, idle_s = 0.0, 0.0
    window, tokens, forward_s, round_s = 1, 1.0, 0.0, 1.0
    for _ in range(50):
        rows = 1 + others
        shared = loop.base_s + loop.cold_s(idle_s)
        base = shared / rows + loop.per_session_s + frames.per_forward_s
        costs = CostModel(
            alpha=alpha,
            draft_s=draft_s,
            verify_base_s=base + loop.per_drafted_s * others * max(window, 1),
            verify_per_token_s=loop.per_drafted_s,
            rtt_s=2 * one_way_s,
        )
        window = costs.best_gamma(max_window)
        tokens = expected_tokens(alpha, window)
        # the forward's wall time: the whole batch's CPU (one verifier thread)
        pad = padding_factor(windows, rows)
        forward_s = loop.seconds(rows, rows * window * pad, idle_s) + rows * frames.per_forward_s
        round_s = window * draft_s + 2 * one_way_s + forward_s
        target = (sessions - 1) * min(1.0, forward_s / round_s) * loop.fill
        # S sessions' rounds, `rows` of them a forward: the verifier idles in between
        idle_target = max(0.0, round_s * rows / sessions - forward_s)
        if abs(target - others) < 1e-4 and abs(idle_target - idle_s) < 1e-5:
            break
        others = 0.5 * others + 0.5 * target
        idle_s = 0.5 * idle_s + 0.5 * idle_target
    if held:
        plans = plans or drawn_plans(
            sessions=sessions,
            generations=generations,
            max_new_tokens=max_new_tokens,
            alpha=alpha,
            windows=windows or [window],
        )
        run = simulate_rounds(
            plans=plans,
            draft_s=draft_s,
            one_way_s=one_way_s,
            loop=loop,
            frames=frames,
            prefill_s=open_s,
            hold_s=hold_s,
            draft_open_s=draft_open_s,
        )
        return Prediction(
            tokens_per_cpu_s=run.tokens / run.cpu_s,
            per_client_tokens_per_s=run.per_client_tokens_per_s,
            window=round(run.drafted / run.rows),
            tokens_per_forward=run.tokens / run.rows,
            rows_per_forward=run.rows / run.forwards,
            drafted_per_forward=run.drafted / run.forwards,
        )
    rows = 1 + others
    pad = padding_factor(windows, rows)  # its share, its row's padding included
    cpu_s = loop.session_share_s(rows, window * pad, idle_s) + frames.per_forward_s
    # (the first DRAFT follows OPEN on the wire: OPEN's trip is the first round's)
    per_generation = max_new_tokens / tokens * round_s + open_s
    return Prediction(
        tokens_per_cpu_s=tokens / cpu_s,
        per_client_tokens_per_s=max_new_tokens / per_generation,
        window=window,
        tokens_per_forward=tokens,
        rows_per_forward=rows,
        drafted_per_forward=rows * window,
    )


Plan = Sequence[Sequence[tuple[int, int]]]
"""A client's generations, each its rounds in order: (drafted tokens, tokens delivered)."""


@dataclass
class _Client:
    """One simulated client in DRAFT rounds, and its session as the batcher sees it."""

    plan: list[list[tuple[int, int]]]
    """Its rounds to go: the current generation first."""
    arrives: float | None = None
    """When its next request reaches the batcher (None: all its generations done)."""
    queued: bool = False
    served_at: float | None = None
    """When its last forward ended (None: a session not served yet)."""
    cycle_s: float | None = None
    """The batcher's running mean of its served-to-next-request time."""
    missed: bool = False
    """A hold waited for it in vain: not waited for again until it is back."""
    leaves_at: float = float("inf")
    """When its session's CLOSE reaches the verifier: its consent withdrawn."""
    joins_at: float = 0.0
    """When its next session's OPEN is through its prefill: its consent registered, a
    session the batcher has not served yet. Between the two the batcher knows no session of
    this client."""
    done_at: float = 0.0

    def consenting(self, now: float) -> bool:
        """Whether a session of this client has its consent registered at `now` (its next
        session's taking over from its last at `joins_at`: one the batcher has not served)."""
        if now < self.leaves_at:
            return True
        if self.arrives is None or now < self.joins_at:  # done, or between two sessions
            return False
        if self.leaves_at != float("inf"):
            self.leaves_at = float("inf")
            self.served_at = self.cycle_s = None
            self.missed = False
        return True

    @property
    def window(self) -> int:
        return self.plan[0][0][0]

    def expected(self) -> float | None:
        if self.served_at is None or self.cycle_s is None:
            return None
        return self.served_at + self.cycle_s


@dataclass(frozen=True)
class RoundsRun:
    """What `simulate_rounds` saw the verifier do."""

    forwards: int
    rows: int
    drafted: int
    """Drafted tokens checked, padding excluded."""
    slots: int
    """Token slots computed: each forward's rows x its longest feed."""
    tokens: int
    """Tokens delivered."""
    cpu_s: float
    """The verifier's CPU: the forwards (the loop's costs, cold starts after idle included),
    each row's frames, each generation's prefill."""
    wall_s: float
    per_client_tokens_per_s: float
    held_s: float
    by_rows: dict[int, int]


def simulate_rounds(
    *,
    plans: Sequence[Plan],
    draft_s: float,
    one_way_s: float,
    loop: LoopCosts,
    frames: FrameCosts,
    prefill_s: float,
    hold_s: float,
    draft_open_s: float = 0.0,
    max_batch: int | None = None,
    max_padding_share: float | None = None,
    cycle_weight: float | None = None,
) -> RoundsRun:
    """Closed-loop clients in DRAFT rounds on one verifier, event by event: each client's
    `plans` (its generations' rounds, in order), its batcher's hold policy played as
    spec_decoding/batching.py plays it (`BatchedTarget._hold`, `_awaited`, `_take`): a leader
    whose sessions consent to `hold_s` waits, until the shortest consent runs out, for the
    consenting sessions not queued that are due by then (their mean cycle from their last
    forward; a session not served yet, or whose cycle is not known yet, is due; one a hold
    waited for in vain is not waited for again until it is back); none due, but one due
    within half a cycle after the deadline, it holds its whole consent anyway (drift). Then
    the oldest request and the others, shortest feed first, within `max_batch` and
    `max_padding_share` of the slots padding (by default the batcher's: `spec.max_batch`,
    `batching.MAX_PADDING_SHARE`, its cycle's running mean `batching.TURNAROUND_WEIGHT`).

    Every client starts at 0. A generation: OPEN, then the draft's prefill (`draft_open_s`)
    and its first window drafted, its DRAFT behind OPEN on the wire; the verifier's prefill
    (`prefill_s` of its CPU, off the batcher's thread) before the session's consent is
    registered and its DRAFT read. Then its rounds: drafted at `draft_s` a token, a one-way
    trip, the forward, the verdict's trip back; after the last, CLOSE and the next OPEN go
    out together, and the session's consent stays registered until CLOSE arrives. A
    forward's CPU is the loop's over its
    rows and its padded drafted slots, after the verifier's idle before it (held time
    included), and each row's frames. Where the policy's rows are what a fixed point cannot
    say (who is due, a session whose windows run long refused for padding and drifting
    apart, a new generation's session unknown to the batcher, the run's tail when some
    clients are done), this counts them."""
    # the batcher's own settings where not given (imported here: torch stays out of this module)
    from spec_decoding.batching import MAX_PADDING_SHARE, TURNAROUND_WEIGHT
    from spec_decoding.config import SpecConfig

    max_batch = SpecConfig().max_batch if max_batch is None else max_batch
    max_padding_share = MAX_PADDING_SHARE if max_padding_share is None else max_padding_share
    cycle_weight = TURNAROUND_WEIGHT if cycle_weight is None else cycle_weight
    clients = [_Client(plan=[list(g) for g in plan if g]) for plan in plans]
    clients = [c for c in clients if c.plan]
    if not clients:
        raise ValueError("no rounds to simulate")

    def opened(client: _Client, sent: float) -> None:  # OPEN out at `sent`, its DRAFT behind
        client.joins_at = sent + one_way_s + prefill_s
        client.arrives = sent + one_way_s + max(prefill_s, draft_open_s + client.window * draft_s)

    cpu = 0.0
    for client in clients:
        client.leaves_at = 0.0  # no session yet
        opened(client, 0.0)
        cpu += prefill_s
    queue: list[_Client] = []  # in arrival order
    now = last_end = held_s = 0.0
    forwards = rows = drafted = slots = tokens = 0
    by_rows: dict[int, int] = {}

    def admit() -> None:
        came = [c for c in clients if c.arrives is not None and not c.queued and c.arrives <= now]
        for client in sorted(came, key=lambda c: c.arrives or 0.0):
            assert client.arrives is not None
            client.consenting(client.arrives)  # (a new session: no cycle from the last one)
            client.queued, client.missed = True, False
            queue.append(client)
            if client.served_at is not None:
                cycle = client.arrives - client.served_at
                mean = client.cycle_s
                if mean is not None:
                    cycle = min(cycle, 2 * mean)
                client.cycle_s = cycle if mean is None else mean + cycle_weight * (cycle - mean)

    def awaited(deadline: float) -> tuple[list[_Client], bool]:
        mine = min((c.cycle_s for c in queue if c.cycle_s is not None), default=float("inf"))
        due, drift = [], False
        for client in clients:
            if client.queued or client.missed or not client.consenting(now):
                continue
            expected = client.expected()
            if expected is None or expected <= deadline:
                due.append(client)
            elif client.cycle_s is not None:
                drift = drift or expected - deadline < min(client.cycle_s, mine) / 2
        return due, drift

    def hold() -> None:
        nonlocal now, held_s
        started, held, ran_out = now, False, False
        due: list[_Client] = []
        while queue and len(queue) < max_batch:
            deadline = min((c.arrives or 0.0) + hold_s for c in queue)
            due, drift = awaited(deadline)
            if deadline <= now:
                ran_out = True
                break
            if not (due or drift):
                break
            held = True
            events = [c.arrives for c in clients if c.arrives is not None and not c.queued]
            events += [t for c in clients for t in (c.leaves_at, c.joins_at) if t > now]
            now = min(min(events, default=deadline), deadline)  # a session that comes,
            admit()  # leaves or joins wakes the leader
        for client in due if held and ran_out else ():
            client.missed = True
        held_s += now - started

    def take() -> list[_Client]:
        head, *others = queue
        batch = [head]
        for request in sorted(others, key=lambda c: c.window):
            if len(batch) == max_batch:
                break
            feeds = [c.window + 1 for c in (*batch, request)]
            if max(feeds) * len(feeds) - sum(feeds) > max_padding_share * max(feeds) * len(feeds):
                continue
            batch.append(request)
        for request in batch:
            queue.remove(request)
        return batch

    while True:
        admit()
        if not queue:
            coming = [c.arrives for c in clients if c.arrives is not None]
            if not coming:
                break
            now = max(now, min(coming))
            continue
        if hold_s > 0:
            hold()
        batch = take()
        longest = max(c.window for c in batch)
        cost = loop.seconds(len(batch), len(batch) * longest, now - last_end)
        cost += len(batch) * frames.per_forward_s
        now += cost
        cpu, last_end = cpu + cost, now
        forwards, rows = forwards + 1, rows + len(batch)
        slots += len(batch) * (longest + 1)
        by_rows[len(batch)] = by_rows.get(len(batch), 0) + 1
        for client in batch:
            window, got = client.plan[0].pop(0)
            drafted, tokens = drafted + window, tokens + got
            client.queued, client.served_at = False, now
            if client.plan[0]:
                client.arrives = now + 2 * one_way_s + client.window * draft_s
                continue
            client.plan.pop(0)
            client.leaves_at = now + 2 * one_way_s  # the verdict back, CLOSE out
            if client.plan:  # and the next OPEN with it
                opened(client, now + one_way_s)
                cpu += prefill_s
            else:
                client.arrives, client.done_at = None, now + one_way_s
    delivered = [sum(got for g in plan for _, got in g) for plan in plans]
    return RoundsRun(
        forwards=forwards,
        rows=rows,
        drafted=drafted,
        slots=slots,
        tokens=tokens,
        cpu_s=cpu,
        wall_s=max(c.done_at for c in clients),
        held_s=held_s,
        by_rows=by_rows,
        per_client_tokens_per_s=statistics.mean(
            n / c.done_at for n, c in zip([d for d in delivered if d], clients, strict=True)
        ),
    )


def drawn_plans(
    *,
    sessions: int,
    generations: int,
    max_new_tokens: int,
    alpha: float,
    windows: Sequence[int],
    seed: int = 0,
) -> list[list[list[tuple[int, int]]]]:
    """Plans for `simulate_rounds` where no session's rounds were recorded: each round's
    window drawn from `windows` (at most the tokens left less one), its drafts accepted each
    with chance `alpha` while all before it were, the target's own token after them."""
    rng = np.random.default_rng(seed)
    pool = [w for w in windows if w >= 0] or [1]
    plans = []
    for _ in range(sessions):
        plan = []
        for _ in range(generations):
            rounds, left = [], max_new_tokens
            while left > 0:
                window = max(0, min(int(rng.choice(pool)), left - 1))
                accepted = 0
                while accepted < window and rng.random() < alpha:
                    accepted += 1
                got = min(accepted + 1, left)
                rounds.append((window, got))
                left -= got
            plan.append(rounds)
        plans.append(plan)
    return plans


def padding_factor(windows: Sequence[int], rows: float) -> float:
    """How many drafted-token slots a forward of `rows` sessions computes per drafted token a
    session brings: every row is padded to the longest window in it, so the forward computes
    rows x (the longest of `rows` draws) where its sessions brought rows x (the mean draw).
    `windows`: a session's drafted tokens round by round (from one session alone; each
    session's window varies as `gamma=auto` follows its acceptance); the longest of n draws
    taken from their empirical distribution, exactly, n interpolated between whole rows. 1:
    no spread, or no windows."""
    values = np.sort(np.asarray([w for w in windows if w >= 0], dtype=float))
    if len(values) == 0 or values.mean() <= 0:
        return 1.0
    cdf = np.arange(1, len(values) + 1) / len(values)  # P(draw <= values[i])

    def longest(n: int) -> float:  # E[max of n draws] = sum v_i (F_i^n - F_{i-1}^n)
        return float(np.sum(values * (cdf**n - np.concatenate(([0.0], cdf[:-1])) ** n)))

    low = max(int(np.floor(rows)), 1)
    share = min(max(rows - low, 0.0), 1.0)
    expected = (1 - share) * longest(low) + share * longest(low + 1)
    return expected / float(values.mean())


def predict_target_alone(
    *,
    sessions: int,
    loop: LoopCosts,
    frames: FrameCosts,
    one_way_s: float,
    max_new_tokens: int,
    open_s: float = 0.0,
) -> Prediction:
    """S clients of the target alone on the same batching loop: one forward of one committed
    token a client per token, serving the loop's `fill` of the others; a token costs its share
    of that forward's base, its row and its frames; and each generation's OPEN, `open_s` (the
    target's time on it: where `frames` was measured without it, `FrameCosts.measured`'s
    `opened_s`; its first token's forward is in both, one in 64 here)."""
    rows = 1 + (sessions - 1) * loop.fill
    cpu_per_token = loop.session_share_s(rows) + frames.per_forward_s
    step_s = sessions * cpu_per_token  # a token of every client, one after another
    per_generation = max_new_tokens * step_s + 2 * one_way_s + open_s
    generation_cpu_s = open_s + max_new_tokens * cpu_per_token
    return Prediction(
        tokens_per_cpu_s=max_new_tokens / generation_cpu_s,
        per_client_tokens_per_s=max_new_tokens / per_generation,
        rows_per_forward=rows,
    )
