"""Choosing the draft length: fixed, or `auto` from the expected-speedup model.

With per-token acceptance rate a, a draft of g tokens yields on average
E(a, g) = (1 - a^(g+1)) / (1 - a) tokens per round (Leviathan et al. 2023, eq. 1). A round
costs g draft steps, one verification of g + 1 tokens, and one network round trip:
T(g) = g * t_draft + t_verify(g + 1) + t_rtt. `auto` picks the g in 1..max_gamma with the most
tokens per second E / T, from running estimates of a, t_draft, t_verify (linear in the tokens
verified) and t_rtt, so it adapts when the link or the acceptance rate changes.

Pipelined (`spec.pipeline`), the drafter keeps drafting while the verifier checks, so a round's
draft time mostly hides behind the verifier's and the link's. `PipelineModel` follows one
epoch (from a rejection to the next) through the same measured costs: when each drafted token
reaches the verifier, which arrive together and share a forward pass, and when a wrong one is
found; the expected tokens per second then follow from the acceptance rate (a renewal-reward
average over where the first wrong token falls). There `gamma` is the window: how many drafted
tokens may await the verifier's word at once.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per round: accepted drafts plus the target's own token."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    alpha: float
    draft_s: float
    """One draft step."""
    verify_base_s: float
    verify_per_token_s: float
    rtt_s: float
    verify_per_doubling_s: float = 0.0
    """A forward of n tokens: base + n * per_token + log2(n) * per_doubling (fit_verify_costs)."""

    def round_seconds(self, gamma: int) -> float:
        return gamma * self.draft_s + verify_seconds(self, gamma + 1) + self.rtt_s

    def tokens_per_second(self, gamma: int) -> float:
        return expected_tokens(self.alpha, gamma) / self.round_seconds(gamma)

    def best_gamma(self, max_gamma: int) -> int:
        return max(range(1, max_gamma + 1), key=self.tokens_per_second)


def _moved(before: PipelineModel | None, now: PipelineModel) -> bool:
    """Whether the model's inputs moved enough to choose again (see `rechoose`)."""
    if before is None:
        return True
    rates = [(before.alpha, now.alpha), (before.branch_hit, now.branch_hit)]
    rates += [(before.branch_share, now.branch_share), (before.branch_cover, now.branch_cover)]
    if any(abs(a - b) >= 0.05 for a, b in rates):
        return True
    if (before.alpha_after_wrong is None) != (now.alpha_after_wrong is None) or (
        now.alpha_after_wrong is not None
        and abs(now.alpha_after_wrong - (before.alpha_after_wrong or 0.0)) >= 0.05
    ):
        return True
    times = [(before.draft_s, now.draft_s), (before.one_way_s, now.one_way_s)]
    times += [(before._verify_s(n), now._verify_s(n)) for n in (1, 4, 16)]
    return any(abs(b - a) > 0.15 * max(a, 1e-4) for a, b in times)


def verify_seconds(model: CostModel | PipelineModel, fed: int) -> float:
    """A forward pass over `fed` tokens, as the model's fitted costs have it."""
    return (
        model.verify_base_s
        + model.verify_per_token_s * fed
        + model.verify_per_doubling_s * math.log2(max(fed, 1))
    )


def fit_verify_costs(forwards: Iterable[tuple[int, float]]) -> tuple[float, float, float]:
    """(base, per token, per doubling) seconds of a forward pass over n tokens, base + n *
    per_token + log2(n) * per_doubling, fitted to (tokens fed, seconds) pairs by least squares
    with no term negative (a term that fits negative is dropped and the rest refitted).

    Not a line: on a CPU a forward is memory-bound at a few tokens, so more tokens cost less
    and less each (the bench target, one thread: 9.0 ms for 1, 11.7 for 2, 14.9 for 5, 16.5
    for 9, 18.7 for 17, 22.4 for 33); a line through the few-token forwards a run sees put 33
    at 38 ms and made wide windows look costly. A big model's compute-bound forward is closer
    to a line, a GPU's nearly flat: the fit takes whichever the measurements say. With two
    sizes seen, the doubling term alone; with one, its mean time."""
    pairs = [
        (n, s) for n, s in forwards if 1 <= n <= 1e6 and math.isfinite(s) and s >= 0
    ]  # (a pair that is no forward's is no measurement: NaN would stall the simulation)
    tokens = np.array([n for n, _ in pairs], dtype=float)
    seconds = np.array([s for _, s in pairs], dtype=float)
    sizes = len(set(tokens.tolist()))
    if sizes < 2:
        return (float(seconds.mean()) if len(seconds) else 0.0), 0.0, 0.0
    columns = {"base": np.ones_like(tokens), "n": tokens, "log2": np.log2(tokens)}
    if sizes < 3:
        del columns["n"]
    while True:
        design = np.column_stack(list(columns.values()))
        coefs = np.linalg.lstsq(design, seconds, rcond=None)[0]
        fitted = dict(zip(columns, coefs, strict=True))
        negative = [name for name, value in fitted.items() if value < 0]
        if not negative or len(columns) == 1:
            break
        del columns[min(negative, key=lambda name: fitted[name])]
    return tuple(max(float(fitted.get(name, 0.0)), 0.0) for name in ("base", "n", "log2"))  # type: ignore[return-value]


@dataclass
class PipelineModel:
    alpha: float
    draft_s: float
    """One drafter step: drafting a token and sending it."""
    verify_base_s: float
    verify_per_token_s: float
    one_way_s: float
    """Half the measured round trip, the verifier's time excluded."""
    verify_per_doubling_s: float = 0.0
    """A forward of n tokens: base + n * per_token + log2(n) * per_doubling (fit_verify_costs)."""
    max_horizon: int = 96
    alone: bool = False
    """The verifier decodes by itself when it holds no draft (`spec.decode_alone`): the rate
    then comes from `simulate_pipeline`."""
    alpha_after_wrong: float | None = None
    """The chance a drafted token is right just after one that was wrong (None: the same as
    any, `alpha`). Wrong guesses cluster (hard stretches of text): the bench pair's greedy
    guesses are right 0.58 of the time after a wrong one, 0.79 after a right one, 0.73 in
    all, and that leaves longer runs to stream through than independent guesses would
    (+8% simulated at 0 and 10 ms one-way). Simulated only."""
    branch_depth: int = 0
    """Tokens per branch, its root included (0 or 1: no branches; simulated only)."""
    branch_hit: float = 0.0
    """The chance that, where a drafted token with branches is wrong, a branch's root is the
    verifier's."""
    branch_share: float = 1.0
    """The share of drafted tokens branched (`spec.branch_flatness`: those the draft is
    unsure of; 1: every one)."""
    branch_cover: float = 1.0
    """The share of wrong drafted tokens that were branched (the unsure ones hold more than
    their share of them)."""

    @property
    def horizon(self) -> int:
        """Tokens into an epoch followed: until the chance of getting that far is below 0.1%."""
        if self.alpha <= 0:
            return 1
        if self.alpha >= 1:
            return self.max_horizon
        return max(1, min(self.max_horizon, math.ceil(math.log(1e-3) / math.log(self.alpha))))

    def _verify_s(self, fed: int) -> float:
        return verify_seconds(self, fed)

    def detection_times(self, window: int) -> list[float]:
        """Seconds from the start of an epoch until the j-th drafted token's verdict is known.

        An epoch starts when the verifier sends a correction. The verifier then runs the
        correction through the target (so the next first guess is checked without a forward);
        the drafter hears of it one way later and, on average, half a step after that starts
        drafting. Each drafted token reaches the verifier one way later; the verifier checks the
        first of what has arrived against the prediction it holds and runs the rest, with the
        first, through one forward pass. The drafter drafts token n only once token n - window
        is confirmed.
        """
        h, d, horizon = self.one_way_s, self.draft_s, self.horizon
        done: list[float] = []  # when the drafter has drafted and sent token n
        confirmed: list[float] = []  # when the drafter learns token n passed
        detect = [0.0] * horizon

        def arrival(n: int) -> float:
            while len(done) <= n:
                m = len(done)
                start = done[-1] if done else h + d / 2
                if m >= window:
                    start = max(start, confirmed[m - window])
                done.append(start + d)
            return done[n] + h

        free = self._verify_s(1)  # the correction's own forward pass
        i = 0
        while i < horizon:
            start = max(free, arrival(i))
            last = i
            while last + 1 < horizon and last + 1 - window < i and arrival(last + 1) <= start:
                last += 1
            end = start + self._verify_s(last - i + 1)
            detect[i] = start
            for n in range(i + 1, last + 1):
                detect[n] = end
            confirmed.extend([end + h] * (last - i + 1))
            free, i = end, last + 1
        return detect

    def tokens_per_second(self, window: int) -> float:
        """Expected tokens per second: E[tokens per epoch] / E[seconds per epoch] (with
        `alone`, the mean of two simulated generations of 300 tokens)."""
        if self.alone or self.branch_depth > 1:
            return statistics.mean(
                simulate_pipeline(self, window, alone=self.alone, tokens=300, seed=s)
                for s in range(2)
            )
        detect = self.detection_times(window)
        tokens = seconds = 0.0
        for j, at in enumerate(detect):  # the first wrong guess is token j
            chance = self.alpha**j * (1 - self.alpha)
            tokens += chance * (j + 1)
            seconds += chance * at
        rest = self.alpha ** len(detect)  # all right up to the horizon
        tokens += rest * len(detect)
        seconds += rest * detect[-1]
        return tokens / seconds if seconds > 0 else 0.0

    def best_window(self, max_window: int, *, tolerance: float = 0.03) -> int:
        """The widest window whose rate is within `tolerance` of the best.

        Past the width the link needs, the rate is flat: the extra tokens are drafted while the
        drafter would otherwise wait. The model's steps are exact and real ones vary, so of
        windows the model finds equal, the widest absorbs that variation best (and the widest
        did best in the bench's runs of fixed windows). Candidates: 1-4, then powers of two and
        1.5 times them (6, 8, 12, 16, 24, 32), and `max_window`; simulated, each is one run of
        400 tokens on the same draws (a choice costs the drafter 10-20 ms, not 25-40).
        """
        candidates = {w for w in (1, 2, 3, 4) if w <= max_window} | {max_window}
        power = 4
        while power < max_window:
            candidates |= {w for w in (power * 3 // 2, power * 2) if w <= max_window}
            power *= 2
        if self.alone or self.branch_depth > 1:
            rates = {
                w: simulate_pipeline(self, w, alone=self.alone, tokens=400, seed=0)
                for w in candidates
            }
        else:
            rates = {w: self.tokens_per_second(w) for w in candidates}
        best = max(rates.values())
        return max(window for window, rate in rates.items() if rate >= (1 - tolerance) * best)


FIRST_GAMMA = 4
"""Rounds: what `gamma=auto` drafts before it has measured a verify and a round trip."""
PIPELINE_PRIOR = 16
"""Pipelined `auto`'s window before anything is measured: past the width a link needs the rate
is flat (the extra drafts are made while the drafter would wait), and on a near link a window
too wide costs the verifier a few wasted tokens per forward; 16 suits links up to ~10 ms one-way
on the bench pair (its best fixed windows: 16-32 there)."""


class GammaController:
    """Running estimates of the cost model, and the draft length (or window) to use next."""

    def __init__(
        self,
        *,
        fixed: int | None,
        max_gamma: int,
        window: int = 32,
        pipelined: bool = False,
        alone: bool = False,
        branch_depth: int = 0,
    ) -> None:
        """`window`: how many recent measurements the estimates follow; `pipelined`, `alone`
        and `branch_depth` as the Drafter it serves runs (spec.pipeline, spec.decode_alone,
        spec.branch_depth)."""
        self.fixed = fixed
        self.max_gamma = max_gamma
        self.pipelined = pipelined
        self.alone = alone
        """Pipelined, the verifier decodes alone when it has no draft (set by the Drafter)."""
        self._accepted: deque[float] = deque(maxlen=window)  # per verdict: tokens accepted
        self._trials: deque[float] = deque(maxlen=window)  # per verdict: acceptance tests made
        self._total_accepted = 0
        self._total_trials = 0
        self._draft: deque[float] = deque(maxlen=window)  # seconds per draft step
        self._verify: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._rtt: deque[float] = deque(maxlen=window)
        self._choice: int | None = None
        self._chosen_for: PipelineModel | None = None
        """What the model was fed when the window was last chosen."""
        self._depth: int | None = None
        self._choosing = False
        self.branch_depth = branch_depth if pipelined else 0
        """spec.branch_depth of a pipelined Drafter that branches (0: no branches)."""
        self._roots = [0, 0]  # wrong tokens in flight with branch roots, and roots hit
        self._flat = [0, 0]  # drafted tokens, and those unsure enough to branch
        self._covered = [0, 0]  # wrong drafted tokens, and those that had been branched
        self._after_wrong: deque[bool] = deque(maxlen=window)  # guesses right after a wrong
        self._last_right = True

    def next_gamma(self) -> int:
        """Rounds: the next draft's length (the rounds model is redone each round, ~1 ms).
        Pipelined: the window, chosen at the end of each generation (`rechoose`), and until
        the first is over `PIPELINE_PRIOR`: the simulated choice costs the drafter 20-40 ms,
        which mid-stream is that long without hearing the verifier (redone every few hundred
        ms, and from a window of 4 until the first costs were in, `auto` ran 0.92-0.95x the
        best fixed window at 10 ms one-way)."""
        if self.fixed is not None:
            return self.fixed
        if self.pipelined:
            return self._choice if self._choice is not None else min(PIPELINE_PRIOR, self.max_gamma)
        if not self._verify or not self._rtt:
            return min(FIRST_GAMMA, self.max_gamma)
        return self.model().best_gamma(self.max_gamma)

    def rechoose(self) -> None:
        """Pipelined `auto`: choose the window and the branch depth again from everything
        measured so far (a Drafter calls this when a generation has all its tokens), if it
        has moved since the last choice: an acceptance rate by 0.05 or more, a time by 15%
        (the same link and pair give the same choice; the simulation costs 20-40 ms)."""
        if self.fixed is not None or not self.pipelined or not self._verify or not self._rtt:
            return
        model = self.pipeline_model(depth=0)
        if self._choice is not None and not _moved(self._chosen_for, model):
            return
        self._chosen_for = model
        self._choice = self.pipeline_model().best_window(self.max_gamma)
        self._depth, self._choosing = None, True
        try:
            self.branch_plan()
        finally:
            self._choosing = False

    def branch_plan(self) -> int:
        """Tokens per branch, root included, for the drafter's next branches (0: none).

        A fixed gamma takes spec.branch_depth as it is. `auto` simulates the pipeline at the
        current window for each depth up to it, with the measured chance that a wrong token's
        branch roots hold the verifier's, and keeps the fastest (none where no depth beats
        it by 2%: a branch costs the drafter a step per token), chosen as the window is."""
        if self.branch_depth < 2:
            return 0
        if self.fixed is not None:
            return self.branch_depth
        if self._depth is None and not self._choosing:
            return 0  # chosen between generations (`rechoose`), as the window is
        if self._depth is None:
            window = self.next_gamma()
            depths = {0, *range(2, min(self.branch_depth, 4) + 1), self.branch_depth}
            rates = {d: self.pipeline_model(depth=d).tokens_per_second(window) for d in depths}
            best = max(rates.values())
            self._depth = min(d for d, rate in rates.items() if rate >= best / 1.02)
        return self._depth

    def new_text(self, weight: float = 8.0) -> None:
        """A new prompt is new text: its acceptance starts from the run's long-run rate, worth
        `weight` checks, instead of the last prompt's recent history. Costs are kept.

        The tiny models fall into loops a draft predicts perfectly; carried over to the next
        prompt, such a streak has `auto` draft the longest drafts into text it has not seen.
        """
        self._accepted.clear()
        self._trials.clear()
        if self._total_trials:
            self._accepted.append(weight * self._total_accepted / self._total_trials)
            self._trials.append(weight)

    def update(
        self, *, drafted: int, accepted: int, draft_s: float, verify_s: float, round_s: float
    ) -> None:
        """One DRAFT round's measurements."""
        self.observe_checks(accepted=accepted, rejected=accepted < drafted)
        if drafted:
            self.observe_draft(draft_s / drafted)
        self.observe_verify(drafted + 1, verify_s)
        self.observe_rtt(max(0.0, round_s - draft_s - verify_s))

    def observe_checks(self, *, accepted: int, rejected: bool) -> None:
        trials = accepted + (1 if rejected else 0)
        self._accepted.append(accepted)
        self._trials.append(trials)
        self._total_accepted += accepted
        self._total_trials += trials
        if trials and not self._last_right:  # the first guess checked after a wrong one
            self._after_wrong.append(accepted > 0)
        if trials:  # (a check's guesses: `accepted` right ones, then a wrong one if rejected)
            self._last_right = not rejected

    def observe_root(self, hit: bool | None) -> None:
        """A drafted token was wrong: whether the verifier's token was one of its branch
        roots (None: it had none, the draft was sure of it)."""
        self._covered[0] += 1
        if hit is not None:
            self._covered[1] += 1
            self._roots[0] += 1
            self._roots[1] += int(hit)

    def observe_flat(self, flat: bool) -> None:
        """A drafted token: whether the draft was unsure enough of it to branch it."""
        self._flat[0] += 1
        self._flat[1] += int(flat)

    @property
    def branch_hit(self) -> float:
        """The chance a wrong token's branch roots hold the verifier's (Laplace's rule)."""
        return (self._roots[1] + 1) / (self._roots[0] + 2)

    @property
    def _gated(self) -> bool:
        """Some drafted token went unbranched (`branch_flatness`): the shares are measured."""
        return self._flat[1] < self._flat[0]

    @property
    def branch_share(self) -> float:
        """The share of drafted tokens branched (1 while every one has been)."""
        return (self._flat[1] + 1) / (self._flat[0] + 2) if self._gated else 1.0

    @property
    def branch_cover(self) -> float:
        """The share of wrong drafted tokens that had been branched (1 while every drafted
        token has been)."""
        return (self._covered[1] + 1) / (self._covered[0] + 2) if self._gated else 1.0

    def observe_draft(self, step_s: float) -> None:
        self._draft.append(step_s)

    def observe_verify(self, fed: int, seconds: float) -> None:
        """A forward pass over `fed` tokens (checks that needed none are not observed)."""
        self._verify.append((fed, seconds))

    def observe_rtt(self, seconds: float) -> None:
        self._rtt.append(seconds)

    def model(self) -> CostModel:
        # Laplace's rule: no streak makes the estimate 1, no run of misses makes it 0
        alpha = (sum(self._accepted) + 1) / (sum(self._trials) + 2)
        draft_s = float(np.median(self._draft)) if self._draft else 0.0
        base, slope, doubling = fit_verify_costs(self._verify)
        rtt = float(np.median(self._rtt)) if self._rtt else 0.0
        return CostModel(
            alpha=min(alpha, 0.999),
            draft_s=draft_s,
            verify_base_s=base,
            verify_per_token_s=slope,
            verify_per_doubling_s=doubling,
            rtt_s=rtt,
        )

    def pipeline_model(self, *, depth: int | None = None) -> PipelineModel:
        """The pipeline's model from the running estimates; `depth`: of its branches (None:
        the depth in use)."""
        costs = self.model()
        if depth is None:
            depth = (self._depth or 0) if self.fixed is None else self.branch_plan()
        after_wrong = (sum(self._after_wrong) + 1) / (len(self._after_wrong) + 2)
        return PipelineModel(
            alpha=costs.alpha,
            alpha_after_wrong=min(after_wrong, 0.999) if self._after_wrong else None,
            draft_s=costs.draft_s,
            verify_base_s=costs.verify_base_s,
            verify_per_token_s=costs.verify_per_token_s,
            verify_per_doubling_s=costs.verify_per_doubling_s,
            one_way_s=costs.rtt_s / 2,
            alone=self.alone,
            branch_depth=depth,
            branch_hit=self.branch_hit,
            branch_share=self.branch_share,
            branch_cover=self.branch_cover,
        )


def _branched(model: PipelineModel, right: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Which positions' drafts are branched: all, or (gated by the draft's flatness) a wrong
    one with chance `branch_cover` and a right one with what keeps the share of branched
    drafts at `branch_share`. Ungated, no draw: the same seed simulates as it did before."""
    if model.branch_share >= 1 and model.branch_cover >= 1:
        return np.ones(right.shape, dtype=bool)
    wrong = 1.0 - model.alpha
    rest = (model.branch_share - wrong * model.branch_cover) / max(model.alpha, 1e-9)
    draws = rng.random(right.shape)
    return np.where(right, draws < min(max(rest, 0.0), 1.0), draws < model.branch_cover)


def _guesses(model: PipelineModel, uniform: np.ndarray) -> np.ndarray:
    """Which positions' guesses are right: independent with chance `alpha`, or a two-state
    chain with `alpha_after_wrong` after a wrong one and, after a right one, what keeps the
    long-run rate at `alpha` (so both read the same mean acceptance)."""
    a, after_wrong = model.alpha, model.alpha_after_wrong
    if after_wrong is None or not 0 < a < 1:
        return uniform < a
    # a chain with mean `a` needs 0 < after_wrong <= a / (1 - a): kept inside (a measured rate
    # after a wrong guess can read above that on few samples)
    after_wrong = min(max(after_wrong, 1e-3), a / (1 - a), 1.0)
    after_right = min(1.0, max(0.0, 1 - after_wrong * (1 - a) / a))
    right = np.empty(len(uniform), dtype=bool)
    previous = True
    for i, u in enumerate(uniform):
        previous = right[i] = u < (after_right if previous else after_wrong)
    return right


def simulate_pipeline(
    model: PipelineModel,
    window: int,
    *,
    alone: bool,
    tokens: int = 400,
    seed: int = 0,
    patience_s: float | None = None,
    forwards: list[int] | None = None,
) -> float:
    """Tokens per second of a pipelined generation, followed event by event along the code
    path: the drafter streams up to `window` unconfirmed tokens, each reaching the verifier
    one way later; the verifier checks what has arrived (the first against the prediction it
    holds, the rest in one forward pass) and, with `alone`, decodes by itself whenever it has
    no draft for its next token, waiting for one only while the drafter's stream is live and
    its last token said more were coming (`patience_s`, by default as the verifier waits: half
    a forward pass of one token, at most 5 ms); its tokens reach the drafter one way later,
    which compares them with its drafts.
    Each position's draft is right with probability `alpha`, drawn once per position (a
    greedy draft guesses a position alike whenever its prefix is right).
    Branches (`model.branch_depth` > 1): each drafted token is branched as soon as it is sent
    (with `branch_share` < 1, the unsure ones: `_branched`),
    which costs the drafter a draft step per branch token (its root is free, the stream's
    tokens fed again cost one), and the branch reaches the verifier one way later; where the
    stream dies at a position whose branch is rooted at the verifier's token (chance
    `branch_hit`), the verifier checks the branch's other tokens in its next forward, once the
    branch is there. `forwards`, if given, gets the tokens of each forward pass the verifier
    ran, in order."""
    h, d = model.one_way_s, model.draft_s
    fed_log = forwards if forwards is not None else []
    if patience_s is None:
        patience_s = min(model._verify_s(1) / 2, 0.005)
    rng = np.random.default_rng(seed)
    right = _guesses(model, rng.random(tokens + 1))
    hit = rng.random(tokens + 1) < model.branch_hit
    depth = model.branch_depth if model.branch_depth > 1 else 0
    branched = _branched(model, right, rng)
    sent_branches: dict[tuple[int, int], float] = {}  # (epoch, place) -> arrival
    # the drafter: its clock, what it knows is committed, its unconfirmed drafts, its stream
    t_d, confirmed, inflight, d_epoch = h + d / 2, 0, 0, 0
    drafts: deque[tuple[float, int, int, bool]] = deque()  # (arrival, epoch, place, more)
    news: deque[tuple[float, int, str]] = deque()  # (arrival, accepted, "" | "fix" | "own")
    blocked = [0.0]  # when the drafter began waiting for news not yet sent

    def drafter_step() -> None:
        """The drafter's next action: take in news that has arrived, else draft, else wait."""
        nonlocal t_d, confirmed, inflight, d_epoch
        if news and news[0][0] <= t_d:
            _, accepted, kind = news.popleft()
            if kind == "branch" or kind == "branch fix":  # the verifier's own tokens
                held = min(inflight, accepted)  # ours where we had drafted them
                confirmed += accepted + (kind == "branch fix")
                inflight -= held
                if held < accepted or kind == "branch fix":
                    inflight, d_epoch = 0, d_epoch + 1
            else:
                confirmed, inflight = confirmed + accepted, inflight - accepted
                if kind == "own" and inflight and right[confirmed]:
                    confirmed, inflight = confirmed + 1, inflight - 1  # its draft was the token
                elif kind:
                    confirmed, inflight, d_epoch = confirmed + 1, 0, d_epoch + 1
        elif inflight < window and confirmed + inflight < tokens:
            t_d += d
            place = confirmed + inflight
            more = inflight + 1 < window and place + 1 < tokens
            drafts.append((t_d + h, d_epoch, place, more))
            inflight += 1
            if depth and branched[place]:  # its branch, drafted as soon as it is sent
                t_d += depth * d
                sent_branches[(d_epoch, place)] = t_d + h
        elif news:
            t_d = max(t_d, news[0][0])
        else:  # waits for the verifier's word, which it has not sent yet
            blocked[0], t_d = t_d, math.inf

    def tell(arrival: float, accepted: int, kind: str) -> None:
        nonlocal t_d
        news.append((arrival, accepted, kind))
        if t_d == math.inf:  # the drafter was waiting for this
            t_d = max(blocked[0], arrival)

    t_v, committed, held, epoch, dead, coming = 0.0, 0, True, -1, False, True
    pending: list[int] = []
    branch: list[int] = []  # a branch's places being checked
    died: tuple[int, int] | None = None  # (epoch, place) where the stream died on a hit root

    def check(places: list[int]) -> tuple[int, bool]:
        """The verifier's step over drafts for `places` (a stream's or a branch's): the first
        against the prediction it holds, all in one forward unless that check failed;
        (accepted, whether one was wrong)."""
        nonlocal t_v
        if held and not right[places[0]]:
            return 0, True  # the free check failed: no forward pass
        t_v += model._verify_s(len(places) + (0 if held else 1))
        fed_log.append(len(places) + (0 if held else 1))
        accepted = 0
        while accepted < len(places) and right[places[accepted]]:
            accepted += 1
        return accepted, accepted < len(places)

    def stream_died(place: int) -> None:
        nonlocal died
        died = (epoch, place) if depth and branched[place] and hit[place] else None

    while committed < tokens:
        while t_d <= t_v:
            drafter_step()
        while drafts and drafts[0][0] <= t_v:  # take in what has arrived
            _, e, at, more = drafts.popleft()
            if e < epoch or (e == epoch and dead):
                continue
            coming = more
            if e > epoch:
                epoch, dead, pending, died = e, False, [], None
            if at < committed:  # compared with a token the verifier decided alone
                if not right[at] and not dead:
                    dead, pending = True, []
                    stream_died(at)
            elif not dead:
                pending.append(at)
        if died is not None and sent_branches.get(died, math.inf) <= t_v:  # taken
            start = died[1] + 1
            places = list(range(start, min(start + depth - 1, tokens)))
            agree = [p for p in places if p < committed]
            if all(right[p] for p in agree):
                branch = [p for p in places if p >= committed]
            died = None
        if branch:  # checked first, as pending drafts would be
            accepted, wrong = check(branch)
            committed += accepted + int(wrong)
            tell(t_v + h, accepted, "branch fix" if wrong else "branch")
            held, branch = not wrong, []
            if pending:  # a newer stream's drafts for what the branch committed
                if not all(right[p] for p in pending if p < committed):
                    dead, pending = True, []
                pending = [p for p in pending if p >= committed]
            continue
        if pending:
            accepted, wrong = check(pending)
            committed += accepted + int(wrong)
            tell(t_v + h, accepted, "fix" if wrong else "")
            if wrong:
                stream_died(pending[accepted])
            held, pending, dead = not wrong, [], dead or wrong
            continue
        if not held:
            t_v += model._verify_s(1)  # the prediction after the committed tokens
            fed_log.append(1)
            held = True
            continue
        next_draft = drafts[0][0] if drafts else math.inf
        if died is not None:  # a branch on its way is worth waiting for as a draft is
            next_draft = min(next_draft, sent_branches.get(died, math.inf))
        if alone and next_draft > t_v + (patience_s if coming and not dead else 0.0):
            committed, held = committed + 1, False
            tell(t_v + h, 0, "own")
            continue
        while not drafts and t_d < math.inf:  # wait for the drafter's next token
            drafter_step()
        if not drafts:
            raise RuntimeError("the simulated verifier and drafter wait for each other")
        t_v = max(t_v, min(drafts[0][0], next_draft))
    return committed / t_v if t_v > 0 else 0.0
