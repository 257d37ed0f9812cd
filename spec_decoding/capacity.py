"""A verifier serving several drafters: its capacity as the pipeline model predicts it.

Capacity is tokens delivered per second of the target host's CPU. Across a WAN link one
user's speculative decoding barely beats the target alone ("Speculation at a Distance"): the
gain is the host's, which checks several tokens of each drafter in one forward where the target
alone decodes one token per client per forward. The verifier batches its sessions' forwards
(spec_decoding/batching.py), so a forward over S sessions costs what a forward over their
tokens together costs (`BatchCosts`, measured locally).

The model, from single-session costs: each session is `gamma.simulate_pipeline`'s session (its
acceptance, draft step and link), on a verifier whose forward over its `fed` tokens costs the
batch's forward over `fed` plus the tokens the other sessions bring to it (each there as often
as it is busy at the verifier), found as a fixed point. The target
alone, batched alike, runs one forward of S tokens per token of each client. Both add the
verifier's own work per delivered token beyond its forwards (messages, bookkeeping), measured
on a single session of each kind.

What one session alone cannot show, measured locally too (`SharedLoop`): S sessions decoding in
threads through one batcher (no link). A forward does not find every waiting session in it
(each comes back from its own bookkeeping a moment after the last forward ended), and S threads
handing the batcher round cost more per token than one: the loop's rows per forward, its
forwards' CPU per token and its threads' CPU beyond the forwards, against one session's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from spec_decoding.gamma import PipelineModel, fit_verify_costs, simulate_pipeline


@dataclass(frozen=True)
class BatchCosts:
    """Seconds of one batched forward over n tokens in all: base + n * per_token + log2(n) *
    per_doubling (gamma.fit_verify_costs over (tokens, seconds) measurements)."""

    base_s: float
    per_token_s: float
    per_doubling_s: float

    @classmethod
    def fit(cls, forwards: Iterable[tuple[int, float]]) -> BatchCosts:
        return cls(*fit_verify_costs(forwards))

    def seconds(self, tokens: float) -> float:
        tokens = max(tokens, 1.0)
        return self.base_s + self.per_token_s * tokens + self.per_doubling_s * math.log2(tokens)


@dataclass(frozen=True)
class SharedLoop:
    """S sessions decoding alone (one token a forward) in threads through one batcher, no
    link, measured locally (thread CPU time): what batching costs beyond the forward curve."""

    sessions: int
    rows_per_forward: float
    """Sessions one forward served, on average (at most `sessions`)."""
    forward_s_per_token: float
    """The forwards' CPU per token (every session's tokens): printed beside the curve, not
    used (measured at another moment than the curve, it would mix two loads in one ratio)."""
    extra_s_per_token: float
    """The sessions' threads' CPU beyond their forwards, per token (the batcher's hand-over,
    each session's bookkeeping, thread switching)."""
    single_extra_s_per_token: float
    """The same with one session alone: what the single-session overhead already holds."""

    @property
    def contention_s_per_token(self) -> float:
        """CPU per token that S sessions add to one's work beyond the forwards."""
        return max(0.0, self.extra_s_per_token - self.single_extra_s_per_token)

    @property
    def fill(self) -> float:
        """The share of the other waiting sessions a forward finds in it (1: all)."""
        if self.sessions < 2:
            return 1.0
        return min(1.0, max(0.0, (self.rows_per_forward - 1) / (self.sessions - 1)))


@dataclass
class _SharedVerifier(PipelineModel):
    """A session's view of a batching verifier: its forward over `fed` tokens costs the
    batch's over `fed + others`."""

    batch: BatchCosts | None = None
    others: float = 0.0

    def _verify_s(self, fed: int) -> float:
        assert self.batch is not None
        return self.batch.seconds(fed + self.others)


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


def predict_speculative(
    *,
    sessions: int,
    alpha: float,
    draft_s: float,
    one_way_s: float,
    batch: BatchCosts,
    overhead_s_per_token: float,
    max_window: int,
    max_new_tokens: int,
    alone: bool = False,
    alpha_after_wrong: float | None = None,
    open_s: float = 0.0,
    tokens: int = 400,
    loop: SharedLoop | None = None,
) -> Prediction:
    """S closed-loop drafters on one batching verifier. `alone`: it decodes by itself when it
    holds no draft (`spec.decode_alone`); else it waits for drafts, idle. `overhead_s_per_token`:
    the verifier's CPU per delivered token beyond its forwards; `open_s`: the target's time on
    each generation's OPEN.

    Each session is busy at the verifier a share u of its time (its forwards' seconds over its
    wall time, simulated); a forward finds each other session in it with that chance, so it
    serves 1 + (S - 1) u sessions and holds their tokens (u = 1: every forward serves all).
    `loop` (measured locally): a forward finds only its `fill` of those, and S sessions add its
    `contention_s_per_token` to the overhead."""
    fill = loop.fill if loop is not None else 1.0
    overhead_s_per_token += loop.contention_s_per_token if loop is not None else 0.0
    others, busy = 0.0, 1.0
    for _ in range(12):
        model = _SharedVerifier(
            alpha=min(max(alpha, 0.0), 0.999),
            draft_s=draft_s,
            verify_base_s=batch.base_s,
            verify_per_token_s=batch.per_token_s,
            verify_per_doubling_s=batch.per_doubling_s,
            one_way_s=one_way_s,
            alone=alone,
            alpha_after_wrong=alpha_after_wrong,
            batch=batch,
            others=others,
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
        mean_fed = statistics.mean(fed) if fed else 1.0
        target = (sessions - 1) * busy * fill * mean_fed
        settled = abs(target - others) < 0.05
        others = 0.5 * others + 0.5 * target
        if settled:
            break
    rows = 1 + (sessions - 1) * busy * fill  # sessions a forward serves
    cpu_per_token = forward_s / (2 * tokens) / rows + overhead_s_per_token
    rate = statistics.mean(rates)  # one session's tokens per second of its own wall time
    # the verifier's other work, for every session it serves, delays each forward
    wall_per_token = 1 / rate + rows * overhead_s_per_token
    per_generation = max_new_tokens * wall_per_token + 2 * one_way_s + open_s
    return Prediction(
        tokens_per_cpu_s=1 / cpu_per_token,
        per_client_tokens_per_s=max_new_tokens / per_generation,
        window=window,
        tokens_per_forward=2 * tokens / max(len(fed), 1),
    )


def predict_target_alone(
    *,
    sessions: int,
    batch: BatchCosts,
    overhead_s_per_token: float,
    one_way_s: float,
    max_new_tokens: int,
    open_s: float = 0.0,
    loop: SharedLoop | None = None,
) -> Prediction:
    """S clients of the target alone on the same batching loop: one forward of S tokens (one
    a client) per token; with `loop` (measured locally), a forward serves only its `fill` of
    the others (on the same curve as the speculative arm's) and S threads add its contention."""
    rows = 1 + (sessions - 1) * (loop.fill if loop is not None else 1.0)
    contention = loop.contention_s_per_token if loop is not None else 0.0
    cpu_per_token = batch.seconds(rows) / rows + overhead_s_per_token + contention
    step_s = sessions * cpu_per_token  # a token of every client, one after another
    per_generation = max_new_tokens * step_s + 2 * one_way_s + open_s
    return Prediction(
        tokens_per_cpu_s=1 / cpu_per_token,
        per_client_tokens_per_s=max_new_tokens / per_generation,
    )


def single_session_overhead(
    *, cpu_s: float, tokens: int, forwards: Iterable[int], batch: BatchCosts
) -> float:
    """The verifier's CPU per delivered token beyond its forwards, from a single session's run:
    its measured CPU less what its forwards (`forwards`: each one's tokens) cost."""
    return max(0.0, (cpu_s - sum(batch.seconds(f) for f in forwards)) / max(tokens, 1))
