"""Client-level differential privacy for fed_learn: DP-FedAvg (McMahan et al. 2018).

Each client clips its update (its adapter minus the global one it trained from, all tensors as
one vector) to L2 norm `fed.dp.clip_norm`; Gaussian noise of standard deviation
`noise_multiplier * clip_norm` goes on the round's weighted sum, so no one client's update can
move the sum by more than the noise hides. Weights are capped (`fed.dp.weight_cap` examples:
weight = min(examples, cap) / cap <= 1), so the clip bounds a client's weighted contribution,
and the sum is divided by a denominator fixed before the round (the sampled clients' capped
weights, which the coordinator knows from their JOINs, not the weights that came back), as
McMahan et al.'s fixed-denominator estimator does.

Who adds the noise: without secure aggregation the coordinator, on the sum it sees (the
central model: the coordinator is trusted with individual updates anyway), as `DPMean`, a
wrapper around the run's strategy; with it each client
adds its share, noise of variance (noise_multiplier * clip_norm)^2 / threshold, so the sum of
any `threshold` survivors' shares (fewer fail the round) carries at least the full noise and no
party ever sees an un-noised sum. More survivors than the threshold over-noise the sum by
sqrt(survivors / threshold): the price of not knowing in advance who drops.

The privacy spent is the subsampled Gaussian mechanism composed over rounds, with the sampling
rate = clients per round / clients in all: computed by Opacus's accountant (RDP or PRV), never a
formula of ours. A noise multiplier can be derived from a target epsilon the same way.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fed_learn.aggregate import Update
from fed_learn.strategy import Strategy

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "prv")


def flat_delta(
    adapter: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """`adapter - base` of every tensor `base` names, in its order, as one float64 vector."""
    parts = [(adapter[name].double() - t.double()).reshape(-1) for name, t in base.items()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`vector` cut back into tensors shaped (and typed) as `like`'s."""
    out, at = {}, 0
    for name, tensor in like.items():
        n = tensor.numel()
        out[name] = vector[at : at + n].reshape(tensor.shape).to(tensor.dtype)
        at += n
    if at != vector.numel():
        raise ValueError(f"a vector of {vector.numel()} entries for {at} adapter entries")
    return out


def clip(delta: torch.Tensor, bound: float) -> tuple[torch.Tensor, float]:
    """`delta` scaled down to L2 norm `bound` if longer; (clipped, norm before)."""
    norm = float(torch.linalg.vector_norm(delta))
    if not math.isfinite(norm):
        raise ValueError("the update is not finite")
    return (delta * (bound / norm) if norm > bound else delta), norm


def noise_std(noise_multiplier: float, sensitivity: float, *, shares: int = 1) -> float:
    """Standard deviation of the noise one party adds: all of it (`shares=1`), or its share
    when `shares` parties' noises add up to the whole. `sensitivity`: the most one client
    moves the sum (its clip norm times its largest weight)."""
    return noise_multiplier * sensitivity / math.sqrt(shares)


def gaussian(numel: int, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Gaussian noise (float64). torch's generator, seeded from the OS unless given one: DP
    noise must not be predictable, so runs pass none."""
    if generator is None:
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    return torch.randn(numel, dtype=torch.float64, generator=generator) * std


class Accountant:
    """The privacy spent so far: Opacus's accountant over the rounds run."""

    def __init__(self, kind: str = "rdp") -> None:
        if kind not in ACCOUNTANTS:
            raise ValueError(f"fed.dp.accountant={kind!r}: one of {', '.join(ACCOUNTANTS)}")
        from opacus.accountants import PRVAccountant, RDPAccountant

        self.kind = kind
        self._impl = RDPAccountant() if kind == "rdp" else PRVAccountant()

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """One round: the subsampled Gaussian mechanism with these parameters."""
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate {sample_rate} must be in (0, 1]")
        self._impl.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def spend(self, noise_multiplier: float, sample_rate: float, delta: float) -> float:
        """One round spent (`step`), logged; the epsilon spent so far."""
        self.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        spent = self.epsilon(delta)
        log.info("privacy spent so far: epsilon %.3f at delta %g", spent, delta)
        return spent

    def epsilon(self, delta: float) -> float:
        if not self._impl.history:
            return 0.0
        with warnings.catch_warnings():  # "optimal order is the largest alpha": a loose bound
            warnings.simplefilter("ignore", UserWarning)
            return float(self._impl.get_epsilon(delta=delta))

    def state(self) -> list[tuple[float, float, int]]:
        """(noise multiplier, sample rate, rounds) runs: enough to rebuild it on resume."""
        return [tuple(entry) for entry in self._impl.history]

    def restore(self, history: list[list[float]]) -> None:
        self._impl.history = [(float(s), float(q), int(n)) for s, q, n in history]


def noise_multiplier_for(
    target_epsilon: float, *, delta: float, sample_rate: float, rounds: int, kind: str = "rdp"
) -> float:
    """The smallest noise multiplier that spends at most `target_epsilon` over `rounds` rounds
    (Opacus's search)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=rounds,
                accountant=kind,
            )
        )


class DPMean(Strategy):
    """DP-FedAvg wrapped around any strategy whose aggregate is a weighted mean (Flower's
    `DifferentialPrivacyServerSideFixedClipping(strategy)`): the coordinator, trusted with
    single updates, clips each one (its adapter minus the round's global one, over the
    tensors the inner strategy trains) to dp.clip_norm and caps its weight at dp.weight_cap;
    the inner strategy aggregates the clipped updates; their step is rescaled to the
    denominator fixed before the round (the sampled clients' capped weights) and Gaussian
    noise of std noise_multiplier x clip_norm x weight_cap / that denominator is added."""

    def __init__(
        self,
        inner: Strategy,
        *,
        dp: Any,
        noise_multiplier: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(prox_mu=inner.prox_mu, rank=inner.rank, combine=inner.combine)
        self.inner, self.dp = inner, dp
        self.noise_multiplier = noise_multiplier
        """The run's (`run_noise_multiplier`), set before the first round."""
        self.generator = generator
        self._global: Mapping[str, torch.Tensor] | None = None
        self._denominator = 0.0

    def client_options(self) -> dict[str, Any]:
        return self.inner.client_options()

    def check_update(
        self, update: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]
    ) -> None:
        self.inner.check_update(update, global_state)

    def trained(self, global_state: Mapping[str, torch.Tensor]) -> list[str]:
        return self.inner.trained(global_state)

    def configure_round(
        self, global_state: Mapping[str, torch.Tensor], sampled_weights: Sequence[int]
    ) -> None:
        self.inner.configure_round(global_state, sampled_weights)
        self._global = global_state
        self._denominator = float(sum(min(int(w), self.dp.weight_cap) for w in sampled_weights))

    def aggregate(self, updates: Sequence[Update]) -> dict[str, torch.Tensor]:
        if self._global is None or self._denominator <= 0:
            raise ValueError("DPMean.aggregate before configure_round: no base to clip around")
        clip_norm, cap = self.dp.clip_norm, self.dp.weight_cap
        base = {name: self._global[name] for name in self.inner.trained(self._global)}
        wide = {name: t.double() for name, t in base.items()}
        clipped: list[Update] = []
        for adapter, weight in updates:
            delta = unflatten(clip(flat_delta(adapter, base), clip_norm)[0], wide)
            moved = {n: (wide[n] + delta[n]).to(t.dtype) for n, t in base.items()}
            clipped.append(({**adapter, **moved}, min(int(weight), cap)))
        mean = self.inner.aggregate(clipped)  # the clipped updates' weighted mean
        taken = float(sum(weight for _, weight in clipped))
        total = flat_delta(mean, base) * taken  # their weighted sum
        std = noise_std(self.noise_multiplier, clip_norm * cap)
        total += gaussian(total.numel(), std, self.generator)
        step = unflatten(total / self._denominator, wide)
        return {**mean, **{n: (wide[n] + step[n]).to(t.dtype) for n, t in base.items()}}


def run_noise_multiplier(fed: Any) -> float:
    """A run's noise multiplier: fed.dp.noise_multiplier, or (0) the smallest that spends
    fed.dp.target_epsilon over fed.rounds at the expected sampling rate (Opacus's search)."""
    dp = fed.dp
    if dp.noise_multiplier > 0:
        return float(dp.noise_multiplier)
    per_round = max(fed.min_fit_clients, math.ceil(fed.fraction_fit * fed.num_clients))
    rate = min(1.0, per_round / fed.num_clients)
    sigma = noise_multiplier_for(
        dp.target_epsilon, delta=dp.delta, sample_rate=rate, rounds=fed.rounds, kind=dp.accountant
    )
    log.info(
        "DP: noise multiplier %.4f for epsilon %g at delta %g over %d rounds (sampling rate %.3f)",
        sigma,
        dp.target_epsilon,
        dp.delta,
        fed.rounds,
        rate,
    )
    return sigma
