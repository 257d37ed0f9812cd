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
) -> Prediction:
    """S closed-loop drafters on one batching verifier. `alone`: it decodes by itself when it
    holds no draft (`spec.decode_alone`); else it waits for drafts, idle. `overhead_s_per_token`:
    the verifier's CPU per delivered token beyond its forwards; `open_s`: the target's time on
    each generation's OPEN.

    Each session is busy at the verifier a share u of its time (its forwards' seconds over its
    wall time, simulated); a forward finds each other session in it with that chance, so it
    serves 1 + (S - 1) u sessions and holds their tokens (u = 1: every forward serves all)."""
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
        target = (sessions - 1) * busy * mean_fed
        settled = abs(target - others) < 0.05
        others = 0.5 * others + 0.5 * target
        if settled:
            break
    rows = 1 + (sessions - 1) * busy  # sessions a forward serves
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
) -> Prediction:
    """S clients of the target alone on the same batching loop: one forward of S tokens (one
    a client) per token."""
    step_s = batch.seconds(sessions) + sessions * overhead_s_per_token
    per_generation = max_new_tokens * step_s + 2 * one_way_s + open_s
    return Prediction(
        tokens_per_cpu_s=sessions / step_s,
        per_client_tokens_per_s=max_new_tokens / per_generation,
    )


def single_session_overhead(
    *, cpu_s: float, tokens: int, forwards: Iterable[int], batch: BatchCosts
) -> float:
    """The verifier's CPU per delivered token beyond its forwards, from a single session's run:
    its measured CPU less what its forwards (`forwards`: each one's tokens) cost."""
    return max(0.0, (cpu_s - sum(batch.seconds(f) for f in forwards)) / max(tokens, 1))
