"""Client-level DP (fed_learn.privacy): clipping, the noise each party adds, and the privacy
spent as Opacus computes it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fed_learn.privacy import (
    Accountant,
    clip,
    flat_delta,
    gaussian,
    noise_multiplier_for,
    noise_std,
    unflatten,
)
from fed_learn.secagg import Params, frac_bits_for

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
