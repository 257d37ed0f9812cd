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
        cls, *, cpu_s: float, forwards: Iterable[int], loop: LoopCosts, wall_s: float = 0.0
    ) -> FrameCosts:
        """From one session's run: the verifier's CPU `cpu_s` less its forwards' loop cost
        (`forwards`: each one's tokens fed, the first its committed token, the rest drafted;
        each after the idle the run's `wall_s` left between them, on average), per forward."""
        fed = list(forwards)
        idle_s = idle_per_forward(wall_s=wall_s, cpu_s=cpu_s, forwards=len(fed))
        looped = sum(loop.seconds(1, max(f - 1, 0)) for f in fed) + len(fed) * loop.cold_s(idle_s)
        return cls(per_forward_s=max(0.0, (cpu_s - looped) / max(len(fed), 1)))


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
    held: bool = False,
    windows: Sequence[int] = (),
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
    `predict_speculative`). `held` (`spec.batch_hold_ms`): every session consents to wait for
    the others, so, served together, they come back together and every forward serves all S
    (the wait itself, the spread of their drafting, is not priced). `windows` (a session's
    drafted tokens round by round, from one session alone): a forward of several sessions pads
    each row to the longest window in it, and computes those slots too (`padding_factor`)."""
    alpha = min(max(alpha, 0.0), 0.999)
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
        target = (sessions - 1) * (1.0 if held else min(1.0, forward_s / round_s) * loop.fill)
        # S sessions' rounds, `rows` of them a forward: the verifier idles in between
        idle_target = max(0.0, round_s * rows / sessions - forward_s)
        if abs(target - others) < 1e-4 and abs(idle_target - idle_s) < 1e-5:
            break
        others = 0.5 * others + 0.5 * target
        idle_s = 0.5 * idle_s + 0.5 * idle_target
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
    of that forward's base, its row and its frames."""
    rows = 1 + (sessions - 1) * loop.fill
    cpu_per_token = loop.session_share_s(rows) + frames.per_forward_s
    step_s = sessions * cpu_per_token  # a token of every client, one after another
    per_generation = max_new_tokens * step_s + 2 * one_way_s + open_s
    return Prediction(
        tokens_per_cpu_s=1 / cpu_per_token,
        per_client_tokens_per_s=max_new_tokens / per_generation,
        rows_per_forward=rows,
    )
