"""Client-level DP (fed_learn.privacy): clipping, the noise each party adds, and the privacy
spent as Opacus computes it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fed_learn.config import DPConfig
from fed_learn.fixed_point import frac_bits_for
from fed_learn.privacy import (
    Accountant,
    DPMean,
    clip,
    flat_delta,
    gaussian,
    noise_multiplier_for,
    noise_std,
    unflatten,
)
from fed_learn.secagg import Params
from fed_learn.strategy import Strategy

from .test_secagg import shared_round


def test_the_accountant_gives_opacus_published_epsilon() -> None:
    """Opacus's own test case (opacus/tests/accountants_test.py): noise 1.5, sample rate
    0.04, 90 epochs of steps, delta 1e-5 -> epsilon 7.32911117143 under RDP."""
    accountant = Accountant("rdp")
    for _ in range(int(90 / 0.04)):
        accountant.step(noise_multiplier=1.5, sample_rate=0.04)
    assert accountant.epsilon(1e-5) == pytest.approx(7.32911117143, abs=1e-6)


def test_a_noise_multiplier_from_a_target_epsilon_spends_at_most_it() -> None:
    """The run's own setting: 10 of 100 clients a round, 20 rounds, epsilon 8, delta 1e-5."""
    sigma = noise_multiplier_for(8.0, delta=1e-5, sample_rate=0.1, rounds=20)
    accountant = Accountant("rdp")
    for _ in range(20):
        accountant.step(noise_multiplier=sigma, sample_rate=0.1)
    spent = accountant.epsilon(1e-5)
    assert 7.5 < spent <= 8.0
    # and the accountant's history rebuilds the same figure (a resumed run)
    again = Accountant("rdp")
    again.restore([list(entry) for entry in accountant.state()])
    assert again.epsilon(1e-5) == spent


def test_clipping_bounds_the_norm_and_keeps_short_updates() -> None:
    base = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    adapter = {"a": torch.full((3, 4), 2.0), "b": torch.ones(5)}
    delta = flat_delta(adapter, base)
    clipped, norm = clip(delta, 1.0)
    assert norm == pytest.approx(math.sqrt(12 * 4 + 5))
    assert float(torch.linalg.vector_norm(clipped)) == pytest.approx(1.0)
    same, _ = clip(delta, 100.0)
    assert torch.equal(same, delta)
    back = unflatten(clipped, base)
    assert back["a"].shape == (3, 4) and back["b"].dtype == torch.float32
    with pytest.raises(ValueError, match="not finite"):
        clip(torch.tensor([float("nan")]), 1.0)


def test_the_noise_on_a_secure_sum_is_at_least_the_whole_noise() -> None:
    """Each client adds its share (variance sigma^2 C^2 / threshold): the unmasked sum of a
    round's inputs carries the sum of the survivors' shares, measured over many entries."""
    sigma, bound, threshold, n = 1.2, 0.5, 3, 5
    params = Params(
        round=0,
        clients=tuple(range(n)),
        threshold=threshold,
        neighbors=4,
        frac_bits=frac_bits_for(n, 1.0, 50.0),
        length=20_001,
    )
    clients, server = shared_round(params)
    std = noise_std(sigma, bound, shares=threshold)
    for c, client in clients.items():
        noise = gaussian(params.length - 1, std).numpy()
        server.add_input(c, client.masked_input(noise, 1))
    survivors, dropped = server.unmask_request()
    for c, client in clients.items():
        server.add_reveal(c, client.reveal(survivors, dropped))
    total, weight, _ = server.aggregate()
    assert weight == n
    measured = float(np.std(total))
    expected = sigma * bound * math.sqrt(n / threshold)  # over-noised by sqrt(n / threshold)
    assert measured == pytest.approx(expected, rel=0.03)
    assert measured >= sigma * bound


def test_noise_is_unpredictable_unless_seeded() -> None:
    assert not torch.equal(gaussian(8, 1.0), gaussian(8, 1.0))
    g = torch.Generator().manual_seed(3)
    h = torch.Generator().manual_seed(3)
    assert torch.equal(gaussian(8, 1.0, g), gaussian(8, 1.0, h))


A, B = "m.q.lora_A.weight", "m.q.lora_B.weight"


def _dp_mean(strategy: str, *, noise: float = 0.0, seed: int = 0) -> DPMean:
    dp = DPConfig(enabled=True, clip_norm=1.0, weight_cap=10, noise_multiplier=max(noise, 1e-9))
    generator = torch.Generator().manual_seed(seed)
    inner = Strategy.create(strategy, rank=2)
    return DPMean(inner, dp=dp, noise_multiplier=noise, generator=generator)


def test_dp_mean_clips_caps_and_divides_by_the_sampled_weights() -> None:
    """DPMean(FedAvg), noise aside: each update's delta clipped to 1, weights capped at 10,
    the weighted sum divided by the sampled clients' capped weights (30: one sampled client
    never answered), whatever the inner mean's own denominator was."""
    base = {A: torch.zeros(2, 3), B: torch.zeros(4, 2)}
    near = {A: torch.full((2, 3), 0.1), B: torch.zeros(4, 2)}  # norm 0.245: kept
    far = {A: torch.zeros(2, 3), B: torch.full((4, 2), 5.0)}  # norm 14.1: clipped to 1
    strategy = _dp_mean("fedavg")
    strategy.configure_round(base, [4, 50, 16])  # capped: 4 + 10 + 10
    merged = strategy.aggregate([(near, 4), (far, 50)])
    assert torch.allclose(merged[A], torch.full((2, 3), 4 * 0.1 / 24), atol=1e-6)
    assert torch.allclose(merged[B], torch.full((4, 2), 10 * (1 / math.sqrt(8)) / 24), atol=1e-6)


def test_dp_mean_keeps_the_inner_strategys_rules_and_noises_only_what_it_trains() -> None:
    """Around FFA-LoRA: clients keep A frozen (its options and check pass through), the noise
    goes on B alone, with the std the accountant assumes (sigma x clip x cap / denominator)."""
    base = {A: torch.randn(2, 3), B: torch.zeros(40, 50)}
    strategy = _dp_mean("ffa", noise=2.0)
    assert strategy.client_options()["freeze_a"] is True
    assert strategy.trained(base) == [B]
    with pytest.raises(ValueError, match="FFA-LoRA clients keep A frozen"):
        strategy.check_update({A: base[A] + 1, B: base[B]}, base)
    strategy.configure_round(base, [10, 10])
    merged = strategy.aggregate([({A: base[A], B: base[B]}, 10), ({A: base[A], B: base[B]}, 10)])
    assert torch.equal(merged[A], base[A])
    assert float(merged[B].std()) == pytest.approx(2.0 * 1.0 * 10 / 20, rel=0.05)
    again = _dp_mean("ffa", noise=2.0, seed=1)
    again.configure_round(base, [10, 10])
    other = again.aggregate([({A: base[A], B: base[B]}, 10)])
    assert not torch.equal(other[B], merged[B])  # fresh noise per generator


def test_dp_mean_is_not_a_strategy_choice_and_needs_its_round() -> None:
    assert "DPMean" not in {cls.__name__ for cls in Strategy.registry.values()}
    with pytest.raises(ValueError, match="before configure_round"):
        _dp_mean("fedavg").aggregate([({A: torch.zeros(1, 1), B: torch.zeros(1, 1)}, 1)])
