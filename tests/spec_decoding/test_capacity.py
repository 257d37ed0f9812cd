"""The capacity model (spec_decoding/capacity.py): what it predicts follows from its inputs."""

from __future__ import annotations

from typing import Any

import pytest

from spec_decoding.capacity import (
    BatchCosts,
    SharedLoop,
    predict_speculative,
    predict_target_alone,
    single_session_overhead,
)
from spec_decoding.gamma import PipelineModel, simulate_pipeline

COSTS = BatchCosts(base_s=0.008, per_token_s=0.0002, per_doubling_s=0.0005)


def test_batch_costs_fit_recovers_a_curve() -> None:
    forwards = [(n, COSTS.seconds(n)) for n in (1, 2, 4, 8, 16, 32)]
    fitted = BatchCosts.fit(forwards)
    for n in (3, 12, 40):
        assert fitted.seconds(n) == pytest.approx(COSTS.seconds(n), rel=1e-6)


def test_the_target_alone_batching_serves_one_token_a_client_a_forward() -> None:
    alone = predict_target_alone(
        sessions=4, batch=COSTS, overhead_s_per_token=0.001, one_way_s=0.05, max_new_tokens=64
    )
    step = COSTS.seconds(4) + 4 * 0.001
    assert alone.tokens_per_cpu_s == pytest.approx(4 / step)
    assert alone.per_client_tokens_per_s == pytest.approx(64 / (64 * step + 0.1))


def speculative(**changes: Any) -> float:
    settings = dict(
        sessions=4, alpha=0.75, draft_s=0.001, one_way_s=0.05, batch=COSTS,
        overhead_s_per_token=0.0, max_window=16, max_new_tokens=64, tokens=300,
    )  # fmt: skip
    settings.update(changes)
    return predict_speculative(**settings).tokens_per_cpu_s  # type: ignore[arg-type]


def test_speculation_multiplies_capacity_as_acceptance_grows() -> None:
    """On a near link a verifier that waits for drafts checks several tokens of each session a
    forward: more per CPU-second than one a client, and more as the draft is right more often.
    Across 50 ms, four sessions leave it idle most of the time: each forward serves fewer of
    them, and more sessions fill it again."""
    alone = predict_target_alone(
        sessions=4, batch=COSTS, overhead_s_per_token=0.0, one_way_s=0.05, max_new_tokens=64
    ).tokens_per_cpu_s
    near = 0.0005
    assert speculative(alpha=0.9, one_way_s=near) > speculative(alpha=0.75, one_way_s=near)
    assert speculative(alpha=0.75, one_way_s=near) > 1.3 * alone
    assert speculative(alpha=0.75) < speculative(alpha=0.75, one_way_s=near)
    assert speculative(alpha=0.75, sessions=16) > speculative(alpha=0.75)


def test_one_session_is_the_pipeline_simulation_itself() -> None:
    """With one session and no other work, the verifier's CPU per token is the simulated
    forwards' time per token: the model adds nothing of its own."""
    model = PipelineModel(
        alpha=0.75, draft_s=0.001, verify_base_s=COSTS.base_s,
        verify_per_token_s=COSTS.per_token_s, verify_per_doubling_s=COSTS.per_doubling_s,
        one_way_s=0.05, alone=False,
    )  # fmt: skip
    prediction = predict_speculative(
        sessions=1, alpha=0.75, draft_s=0.001, one_way_s=0.05, batch=COSTS,
        overhead_s_per_token=0.0, max_window=16, max_new_tokens=64, tokens=300,
    )  # fmt: skip
    fed: list[int] = []
    for seed in range(2):
        simulate_pipeline(
            model, prediction.window, alone=False, tokens=300, seed=seed, forwards=fed
        )
    assert prediction.tokens_per_cpu_s == pytest.approx(600 / sum(COSTS.seconds(f) for f in fed))
    assert prediction.tokens_per_forward == pytest.approx(600 / len(fed))


def test_overhead_is_what_the_forwards_leave_of_the_measured_cpu() -> None:
    overhead = single_session_overhead(cpu_s=1.0, tokens=100, forwards=[1] * 50, batch=COSTS)
    assert overhead == pytest.approx((1.0 - 50 * COSTS.seconds(1)) / 100)
    assert single_session_overhead(cpu_s=0.0, tokens=10, forwards=[1], batch=COSTS) == 0.0


def loop(rows: float, *, contention_s: float = 0.0) -> SharedLoop:
    """Four sessions' loop whose forwards serve `rows` sessions each, at the curve's cost."""
    return SharedLoop(
        sessions=4,
        rows_per_forward=rows,
        forward_s_per_token=COSTS.seconds(rows) / rows,
        extra_s_per_token=0.0005 + contention_s,
        single_extra_s_per_token=0.0005,
    )


def test_a_shared_loop_says_how_full_its_forwards_were_and_what_threads_added() -> None:
    assert loop(4.0).fill == 1.0
    assert loop(2.5).fill == pytest.approx(0.5)
    assert loop(1.0).fill == 0.0
    assert loop(3.0, contention_s=0.0002).contention_s_per_token == pytest.approx(0.0002)
    fewer = SharedLoop(
        sessions=4,
        rows_per_forward=4,
        forward_s_per_token=0.001,
        extra_s_per_token=0.0001,
        single_extra_s_per_token=0.0003,
    )
    assert fewer.contention_s_per_token == 0.0  # threads never make a token cheaper


def test_the_target_alone_pays_for_the_forwards_and_threads_its_loop_measured() -> None:
    """A full loop without contention predicts what the curve alone does; forwards that serve
    fewer sessions, or threads that add CPU, predict fewer tokens per CPU-second, by exactly
    their measured cost."""
    kwargs = dict(
        sessions=4, batch=COSTS, overhead_s_per_token=0.001, one_way_s=0.05, max_new_tokens=64
    )
    plain = predict_target_alone(**kwargs)  # type: ignore[arg-type]
    full = predict_target_alone(**kwargs, loop=loop(4.0))  # type: ignore[arg-type]
    assert full.tokens_per_cpu_s == pytest.approx(plain.tokens_per_cpu_s)
    assert full.per_client_tokens_per_s == pytest.approx(plain.per_client_tokens_per_s)
    partial = predict_target_alone(**kwargs, loop=loop(2.5, contention_s=0.0003))  # type: ignore[arg-type]
    expected = COSTS.seconds(2.5) / 2.5 + 0.001 + 0.0003
    assert partial.tokens_per_cpu_s == pytest.approx(1 / expected)
    assert partial.tokens_per_cpu_s < plain.tokens_per_cpu_s


def test_speculation_on_a_loop_that_batches_less_serves_fewer_sessions_a_forward() -> None:
    near = 0.0005  # the verifier busy: every forward would serve all four
    assert speculative(one_way_s=near, loop=loop(4.0)) == pytest.approx(speculative(one_way_s=near))
    assert speculative(one_way_s=near, loop=loop(2.0)) < speculative(one_way_s=near)
    assert speculative(one_way_s=near, loop=loop(4.0, contention_s=0.001)) < speculative(
        one_way_s=near
    )
