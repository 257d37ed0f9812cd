"""The speculative sampling rule, and the coupling by position, leave the target's
distribution exactly as it is."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from lab.sampling import probs_from_logits
from spec_decoding.sampling import (
    coupled_token,
    greedy_verdict,
    position_noise,
    speculative_verdict,
)

P = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
Q = torch.tensor([0.30, 0.10, 0.30, 0.10, 0.20])  # a draft that disagrees a lot


def sample_outputs(
    p_rows: torch.Tensor, q_rows: torch.Tensor, draws: int, seed: int
) -> torch.Tensor:
    """First output token of many speculative rounds (draft sampled from q each time)."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.empty(draws, dtype=torch.long)
    k = q_rows.size(0)
    for n in range(draws):
        draft = [int(torch.multinomial(q_rows[i], 1, generator=generator)) for i in range(k)]
        accepted, token = speculative_verdict(p_rows, q_rows, draft, generator=generator)
        first[n] = draft[0] if accepted > 0 else token
    return first


@pytest.mark.parametrize("gamma", [1, 3])
def test_first_token_follows_the_target_distribution(gamma: int) -> None:
    draws = 20_000
    p_rows = P.expand(gamma + 1, -1).contiguous()
    q_rows = Q.expand(gamma, -1).contiguous()
    counts = torch.bincount(sample_outputs(p_rows, q_rows, draws, seed=gamma), minlength=5)
    result = chisquare(counts.numpy(), (P * draws).numpy())
    assert result.pvalue > 1e-3, (counts.tolist(), result)


def test_the_draft_distribution_alone_would_fail_that_test() -> None:
    """The statistical test has teeth: drawing straight from q is rejected."""
    draws = 20_000
    counts = torch.bincount(
        torch.multinomial(Q, draws, replacement=True, generator=torch.Generator().manual_seed(0)),
        minlength=5,
    )
    assert chisquare(counts.numpy(), (P * draws).numpy()).pvalue < 1e-6


def test_identical_draft_is_always_accepted() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = P.expand(4, -1).contiguous()
    for _ in range(200):
        draft = [int(torch.multinomial(P, 1, generator=generator)) for _ in range(3)]
        accepted, _ = speculative_verdict(rows, rows[:3], draft, generator=generator)
        assert accepted == 3


def test_greedy_verdict_accepts_the_matching_prefix_then_corrects() -> None:
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])  # argmax 1, 2, 0
    assert greedy_verdict(logits, [1, 2]) == (2, 0)  # all accepted: bonus token
    assert greedy_verdict(logits, [1, 0]) == (1, 2)  # second rejected: target's choice
    assert greedy_verdict(logits, [0, 2]) == (0, 1)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probs_from_logits(logits, temperature=1.0, top_p=0.75)
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    assert probs_from_logits(logits, temperature=1.0, top_p=1.0).sum().item() == pytest.approx(1)


def test_a_coupled_draw_follows_the_target_and_the_draft_guesses_it_often() -> None:
    """Over seeds, the Gumbel-max draw with a position's noise is distributed as p; the
    draft's draw with the same noise equals it at least (1 - d) / (1 + d) of the time (d: the
    total variation between p and q), and more often than independent draws would."""
    draws = 20_000
    ours = [coupled_token(P, position_noise(seed, 7, 5)) for seed in range(draws)]
    guesses = [coupled_token(Q, position_noise(seed, 7, 5)) for seed in range(draws)]
    counts = torch.bincount(torch.tensor(ours), minlength=5)
    assert chisquare(counts.numpy(), (P * draws).numpy()).pvalue > 1e-3, counts.tolist()
    d = 0.5 * float((P - Q).abs().sum())
    matched = sum(a == b for a, b in zip(ours, guesses, strict=True)) / draws
    assert matched >= (1 - d) / (1 + d) - 0.01
    assert matched > float((P * Q).sum()) + 0.05  # independent draws would match this often


def test_position_noise_is_a_function_of_seed_and_position_only() -> None:
    """Both sides draw it: the same bits for the same pair, different for another pair."""
    a = position_noise(3, 41, 4096)
    assert torch.equal(a, position_noise(3, 41, 4096))
    assert not torch.equal(a, position_noise(3, 42, 4096))
    assert not torch.equal(a, position_noise(4, 41, 4096))
    assert torch.isfinite(a).all() and a.dtype == torch.float64
