"""The capacity model (spec_decoding/capacity.py): what it predicts follows from its inputs,
term by term (the shared loop's forward, shared by its sessions; each session's row, drafted
tokens and frames)."""

from __future__ import annotations

from typing import Any

import pytest

from spec_decoding.capacity import (
    FrameCosts,
    LoopCosts,
    padding_factor,
    predict_rounds,
    predict_speculative,
    predict_target_alone,
    simulate_rounds,
)
from spec_decoding.gamma import CostModel, PipelineModel, expected_tokens, simulate_pipeline

LOOP = LoopCosts(
    base_s=0.004, per_session_s=0.0006, per_drafted_s=0.0002, sessions=4, rows_per_forward=4.0
)
FRAMES = FrameCosts(per_forward_s=0.0003)


def test_the_loop_fit_recovers_each_term_from_a_grid_of_sessions_and_drafts() -> None:
    grid = [(s, s * k, LOOP.seconds(s, s * k)) for s in (1, 2, 4) for k in (0, 2, 6)]
    fitted = LoopCosts.fit(grid, sessions=4, rows_per_forward=3.5)
    assert fitted.base_s == pytest.approx(LOOP.base_s)
    assert fitted.per_session_s == pytest.approx(LOOP.per_session_s)
    assert fitted.per_drafted_s == pytest.approx(LOOP.per_drafted_s)
    assert fitted.rows_per_forward == 3.5 and fitted.sessions == 4


def test_the_loop_fit_never_makes_more_work_cheaper() -> None:
    """Drafts that cost nothing measurable (here, a little less) get no negative price: the
    term is dropped and the rest refitted; a quantity never varied gets none either."""
    grid = [(s, s * k, 0.004 + 0.001 * s - 1e-6 * s * k) for s in (1, 2, 4) for k in (0, 2, 6)]
    fitted = LoopCosts.fit(grid)
    assert fitted.per_drafted_s == 0.0 and fitted.per_session_s > 0
    flat = LoopCosts.fit([(4.0, d, 0.005 + 0.0001 * d) for d in (0.0, 8.0, 24.0)])
    assert flat.per_session_s == 0.0
    assert flat.per_drafted_s == pytest.approx(0.0001)
    with pytest.raises(ValueError, match="no measurements"):
        LoopCosts.fit([])


def test_a_forwards_base_is_shared_by_its_sessions_and_the_rest_is_each_ones() -> None:
    assert LOOP.session_share_s(4) == pytest.approx(0.001 + 0.0006)
    assert LOOP.session_share_s(1, 3) == pytest.approx(LOOP.seconds(1, 3))
    assert 4 * LOOP.session_share_s(4, 2) == pytest.approx(LOOP.seconds(4, 8))


def test_the_fill_is_the_share_of_the_other_sessions_a_forward_found() -> None:
    def fill(rows: float) -> float:
        return LoopCosts(0.0, 0.0, 0.0, sessions=4, rows_per_forward=rows).fill

    assert fill(4.0) == 1.0 and fill(1.0) == 0.0
    assert fill(2.5) == pytest.approx(0.5)
    assert LoopCosts(0.0, 0.0, 0.0, sessions=1, rows_per_forward=1.0).fill == 1.0


def test_frames_are_what_one_sessions_cpu_leaves_beyond_its_loop_forwards() -> None:
    forwards = [1, 1, 4, 7]  # tokens fed each: its committed one, the rest drafted
    looped = sum(LOOP.seconds(1, f - 1) for f in forwards)
    frames = FrameCosts.measured(cpu_s=looped + 4 * 0.0005, forwards=forwards, loop=LOOP)
    assert frames.per_forward_s == pytest.approx(0.0005)
    assert FrameCosts.measured(cpu_s=0.0, forwards=forwards, loop=LOOP).per_forward_s == 0.0


def test_the_target_alone_pays_its_share_of_each_forward_its_row_and_its_frames() -> None:
    kwargs: dict[str, Any] = dict(sessions=4, frames=FRAMES, one_way_s=0.05, max_new_tokens=64)
    full = predict_target_alone(loop=LOOP, **kwargs)
    per_token = LOOP.base_s / 4 + LOOP.per_session_s + FRAMES.per_forward_s
    assert full.tokens_per_cpu_s == pytest.approx(1 / per_token)
    assert full.per_client_tokens_per_s == pytest.approx(64 / (64 * 4 * per_token + 0.1))
    assert full.rows_per_forward == 4.0
    half = LoopCosts(LOOP.base_s, LOOP.per_session_s, LOOP.per_drafted_s, 4, 2.5)
    partial = predict_target_alone(loop=half, **kwargs)  # forwards that find half the others
    assert partial.tokens_per_cpu_s == pytest.approx(
        1 / (LOOP.base_s / 2.5 + LOOP.per_session_s + FRAMES.per_forward_s)
    )
    dearer = predict_target_alone(loop=LOOP, **{**kwargs, "frames": FrameCosts(0.0013)})
    assert 1 / dearer.tokens_per_cpu_s - 1 / full.tokens_per_cpu_s == pytest.approx(0.001)
    opened = predict_target_alone(loop=LOOP, **kwargs, open_s=0.064)  # each generation's OPEN
    assert 1 / opened.tokens_per_cpu_s - 1 / full.tokens_per_cpu_s == pytest.approx(0.001)


def speculative(**changes: Any) -> float:
    settings: dict[str, Any] = dict(
        sessions=4, alpha=0.75, draft_s=0.001, one_way_s=0.05, loop=LOOP, frames=FRAMES,
        max_window=16, max_new_tokens=64, tokens=300,
    )  # fmt: skip
    settings.update(changes)
    return predict_speculative(**settings).tokens_per_cpu_s


def test_one_session_is_the_pipeline_simulation_at_the_loops_cost() -> None:
    """One session: each simulated forward costs the loop's forward of one session and its
    drafted tokens, plus its frames; the model adds nothing of its own."""
    prediction = predict_speculative(
        sessions=1,
        alpha=0.75,
        draft_s=0.001,
        one_way_s=0.05,
        max_new_tokens=64,
        loop=LOOP,
        frames=FRAMES,
        max_window=16,
        tokens=300,
    )
    per_forward = LOOP.base_s + LOOP.per_session_s + FRAMES.per_forward_s  # fed 1: no drafts
    model = PipelineModel(
        alpha=0.75,
        draft_s=0.001,
        verify_base_s=per_forward - LOOP.per_drafted_s,
        verify_per_token_s=LOOP.per_drafted_s,
        one_way_s=0.05,
        alone=False,
    )
    fed: list[int] = []
    for seed in range(2):
        simulate_pipeline(
            model, prediction.window, alone=False, tokens=300, seed=seed, forwards=fed
        )
    expected = sum(LOOP.seconds(1, f - 1) + FRAMES.per_forward_s for f in fed)
    assert prediction.tokens_per_cpu_s == pytest.approx(600 / expected)
    assert prediction.tokens_per_forward == pytest.approx(600 / len(fed))
    assert prediction.rows_per_forward == 1.0


def test_speculation_multiplies_capacity_as_acceptance_grows() -> None:
    """On a near link a verifier that waits for drafts checks several tokens of each session a
    forward: more per CPU-second than one a client, and more as the draft is right more often.
    Across 50 ms, four sessions leave it idle most of the time: each forward serves fewer of
    them, and more sessions fill it again."""
    alone = predict_target_alone(
        sessions=4, loop=LOOP, frames=FRAMES, one_way_s=0.05, max_new_tokens=64
    ).tokens_per_cpu_s
    near = 0.0005
    assert speculative(alpha=0.9, one_way_s=near) > speculative(alpha=0.75, one_way_s=near)
    assert speculative(alpha=0.75, one_way_s=near) > 1.3 * alone
    assert speculative(alpha=0.75) < speculative(alpha=0.75, one_way_s=near)
    assert speculative(alpha=0.75, sessions=16) > speculative(alpha=0.75)


def test_speculation_on_a_loop_that_batches_less_or_frames_that_cost_more_serves_fewer() -> None:
    near = 0.0005
    half = LoopCosts(LOOP.base_s, LOOP.per_session_s, LOOP.per_drafted_s, 4, 2.0)
    full = predict_speculative(
        sessions=4, alpha=0.75, draft_s=0.001, one_way_s=near, loop=LOOP, frames=FRAMES,
        max_window=16, max_new_tokens=64, tokens=300,
    )  # fmt: skip
    assert full.rows_per_forward > 3.0
    assert speculative(one_way_s=near, loop=half) < speculative(one_way_s=near)
    assert speculative(one_way_s=near, frames=FrameCosts(0.002)) < speculative(one_way_s=near)


COLD = LoopCosts(
    base_s=0.001,
    per_session_s=0.0007,
    per_drafted_s=0.00004,
    sessions=4,
    rows_per_forward=3.5,
    cold=((0.002, 0.0001), (0.02, 0.0008), (0.1, 0.002), (0.2, 0.0019)),
)


def test_a_forward_after_the_verifier_idled_costs_its_measured_cold_start() -> None:
    """Interpolated between the pauses measured, never falling with a longer pause (0.2 s
    measured a little under 0.1 s: noise), flat past the last; nothing when hot or when no
    pause was measured."""
    assert COLD.cold_s(0.0) == 0.0 and LOOP.cold_s(0.1) == 0.0
    assert COLD.cold_s(0.02) == pytest.approx(0.0008)
    assert COLD.cold_s(0.06) == pytest.approx(0.0008 + (0.002 - 0.0008) * 0.5)
    assert COLD.cold_s(0.2) == COLD.cold_s(1.0) == pytest.approx(0.002)
    assert COLD.seconds(2, 4, 0.1) == pytest.approx(COLD.seconds(2, 4) + 0.002)
    assert COLD.session_share_s(2, 3, 0.1) == pytest.approx(
        (0.001 + 0.002) / 2 + 0.0007 + 3 * 0.00004
    )  # the cold start is the forward's: shared like its base
    fitted = LoopCosts.fit([(1, 0, 0.002), (2, 0, 0.003), (1, 2, 0.0021)], cold=[(0.1, 0.002)])
    assert fitted.cold == ((0.1, 0.002),)


def test_frames_of_a_session_that_left_the_verifier_idle_leave_out_its_cold_starts() -> None:
    forwards = [9] * 10  # rounds: a window of 8 each
    cpu = 10 * (COLD.seconds(1, 8) + COLD.cold_s(0.1) + 0.0003)
    wall = cpu + 10 * 0.1  # 100 ms idle before each forward
    frames = FrameCosts.measured(cpu_s=cpu, forwards=forwards, loop=COLD, wall_s=wall)
    assert frames.per_forward_s == pytest.approx(0.0003)
    unaware = FrameCosts.measured(cpu_s=cpu, forwards=forwards, loop=COLD)
    assert unaware.per_forward_s == pytest.approx(0.0003 + COLD.cold_s(0.1))


def rounds(**changes: Any) -> Any:
    settings: dict[str, Any] = {
        "sessions": 4,
        "alpha": 0.7,
        "draft_s": 0.001,
        "one_way_s": 0.05,
        "loop": COLD,
        "frames": FRAMES,
        "max_window": 32,
        "max_new_tokens": 64,
    }
    settings.update(changes)
    return predict_rounds(**settings)


def test_one_session_in_rounds_is_the_rounds_model_with_the_verifier_idle_between() -> None:
    """One session: the window the rounds model of `gamma=auto` picks from the same costs; a
    round's tokens are Leviathan's expected tokens; its forward costs the loop's forward of one
    row and the window, its frames, and the cold start after the rest of the round idle."""
    one = rounds(sessions=1)
    assert one.rows_per_forward == 1.0
    forward_s = COLD.seconds(1, one.window, 0.1) + FRAMES.per_forward_s  # ~0.1 s idle a round
    round_s = one.window * 0.001 + 0.1 + forward_s
    idle = round_s - forward_s
    cpu = COLD.seconds(1, one.window, idle) + FRAMES.per_forward_s
    assert one.tokens_per_cpu_s == pytest.approx(expected_tokens(0.7, one.window) / cpu, rel=1e-3)
    costs = CostModel(
        alpha=0.7,
        draft_s=0.001,
        verify_base_s=COLD.base_s + COLD.cold_s(idle) + COLD.per_session_s + FRAMES.per_forward_s,
        verify_per_token_s=COLD.per_drafted_s,
        rtt_s=0.1,
    )
    assert one.window == costs.best_gamma(32)
    rounds_a_generation = 64 / expected_tokens(0.7, one.window)
    assert one.per_client_tokens_per_s == pytest.approx(
        64 / (rounds_a_generation * (one.window * 0.001 + 0.1 + cpu)), rel=1e-3
    )


def test_rounds_pay_where_a_forwards_base_outweighs_its_drafted_tokens() -> None:
    """A window checked in one forward: against the target alone's one token a session a
    forward, rounds serve more per CPU-second when a drafted token is cheap beside a forward,
    less when it is dear; a verifier that goes cold between rounds serves fewer; sessions
    that share forwards (more of them, or a near link) serve more."""
    alone = predict_target_alone(
        sessions=4, loop=COLD, frames=FRAMES, one_way_s=0.05, max_new_tokens=64
    ).tokens_per_cpu_s
    assert rounds().tokens_per_cpu_s > alone
    dear = LoopCosts(0.001, 0.0007, 0.002, 4, 3.5, cold=COLD.cold)
    assert rounds(loop=dear).tokens_per_cpu_s < alone
    hot = LoopCosts(COLD.base_s, COLD.per_session_s, COLD.per_drafted_s, 4, 3.5)
    assert rounds(loop=hot).tokens_per_cpu_s > rounds().tokens_per_cpu_s
    assert rounds(sessions=16).rows_per_forward > rounds().rows_per_forward
    assert rounds(sessions=16).tokens_per_cpu_s > rounds().tokens_per_cpu_s
    assert rounds(one_way_s=0.0005).tokens_per_cpu_s > rounds().tokens_per_cpu_s
    assert rounds(alpha=0.9).tokens_per_cpu_s > rounds().tokens_per_cpu_s


def test_a_forward_computes_each_row_padded_to_its_longest_window() -> None:
    """Windows that vary round by round (gamma=auto follows each session's acceptance): a
    forward of n sessions computes n x the longest of n draws; alike windows, or one session,
    pad nothing."""
    assert padding_factor([6] * 10, 4) == pytest.approx(1.0)
    assert padding_factor([2, 8], 1) == pytest.approx(1.0)
    # two rows from {2, 8}: the longest is 8 unless both drew 2 (1/4): 6.5 of a mean 5
    assert padding_factor([2, 8], 2) == pytest.approx(6.5 / 5)
    assert padding_factor([2, 8], 1.5) == pytest.approx((1.0 + 6.5 / 5) / 2)
    spread = [3, 5, 7, 9, 12]
    factors = [padding_factor(spread, rows) for rows in (1, 2, 3, 4, 8)]
    assert factors == sorted(factors) and factors[-1] <= max(spread) / (sum(spread) / 5)
    assert padding_factor([], 4) == 1.0


HOLD = 0.02


def simulate(plans: Any, **changes: Any) -> Any:
    settings: dict[str, Any] = {
        "plans": plans,
        "draft_s": 0.001,
        "one_way_s": 0.05,
        "loop": COLD,
        "frames": FRAMES,
        "prefill_s": 0.004,
        "hold_s": HOLD,
    }
    settings.update(changes)
    return simulate_rounds(**settings)


def steady(generations: int = 2, rounds: int = 10, window: int = 6) -> list[list[tuple[int, int]]]:
    """A client whose every round drafts `window` and delivers 4 tokens."""
    return [[(window, 4)] * rounds for _ in range(generations)]


def test_one_client_in_rounds_pays_each_forward_after_its_round_trip_idle_and_each_prefill() -> (
    None
):
    """Each forward: the loop's forward of one row and its window after the verifier idled a
    round trip and the drafting; its frames; each generation's prefill; the client's tokens
    over the time until its last verdict is back."""
    run = simulate([steady()])
    assert (run.forwards, run.rows, run.tokens, run.drafted) == (20, 20, 80, 120)
    assert run.by_rows == {1: 20}
    first = COLD.seconds(1, 6, 0.05 + 0.006)  # OPEN's trip, its DRAFT drafted meanwhile
    later = COLD.seconds(1, 6, 0.1 + 0.006)
    assert run.cpu_s == pytest.approx(2 * 0.004 + first + 19 * later + 20 * FRAMES.per_forward_s)
    assert run.held_s == 0.0  # alone: nobody to wait for


def test_held_clients_in_step_share_every_forward() -> None:
    held = simulate([steady()] * 4)
    assert held.by_rows == {4: 20}
    assert held.tokens == 4 * 80


def test_a_hold_gathers_clients_that_drift_apart_without_one() -> None:
    """Clients whose windows differ come back at different times: without a hold each runs
    alone (a forward of one each time); held, they wait for each other, share forwards and
    serve more tokens a CPU-second."""
    plans = [steady(window=w) for w in (3, 5, 7, 9)]
    apart = simulate(plans, hold_s=0.0)
    held = simulate(plans)
    assert apart.rows / apart.forwards < 1.5
    assert held.rows / held.forwards > 3.5
    assert held.tokens == apart.tokens == 4 * 80
    assert held.tokens / held.cpu_s > apart.tokens / apart.cpu_s
    assert held.held_s > 0.0


def test_a_client_whose_windows_run_long_is_refused_for_padding_and_runs_alone() -> None:
    """A window far longer than the others' would make most of a shared forward's slots
    padding: it runs on its own, and the others share theirs."""
    plans = [steady(window=2)] * 3 + [steady(window=16)]
    run = simulate(plans)
    assert run.by_rows == {3: 20, 1: 20}
    assert run.slots == 3 * 20 * 3 + 20 * 17


def test_the_runs_tail_when_some_clients_are_done_is_forwards_of_fewer() -> None:
    plans = [steady(rounds=10)] * 3 + [steady(rounds=15)]
    run = simulate(plans)
    assert run.by_rows == {4: 20, 1: 10}  # the last one alone at the end
    assert run.tokens == 3 * 80 + 120


def test_a_client_gone_quiet_costs_the_others_one_hold_not_one_a_forward() -> None:
    """A client that drafts for 400 ms (four of the others' rounds) is waited for once, in vain,
    then not again until it is back; the others go on in forwards of three."""
    group = [steady(generations=1, rounds=10, window=2)] * 3
    run = simulate([*group, [[(2, 4)] * 3 + [(400, 4)]]])
    assert run.by_rows == {4: 3, 3: 7, 1: 1}
    assert 0 < run.held_s <= 2.5 * HOLD  # (a hold every forward while it was away: 4.5)


def test_held_rounds_are_predicted_from_each_clients_recorded_rounds() -> None:
    """`predict_rounds` with a hold plays the plans out; without plans it draws them from the
    windows and the acceptance."""
    plans = [steady(window=w) for w in (3, 5, 7, 9)]
    held = rounds(hold_s=HOLD, plans=plans, open_s=0.004)
    run = simulate(plans)
    assert held.tokens_per_cpu_s == pytest.approx(run.tokens / run.cpu_s)
    assert held.rows_per_forward == pytest.approx(run.rows / run.forwards)
    drawn = rounds(hold_s=HOLD, windows=[6] * 20)
    assert drawn.rows_per_forward > 3.0
    assert drawn.tokens_per_cpu_s > rounds(windows=[6] * 20).tokens_per_cpu_s


def test_recorded_rounds_that_are_empty_are_refused() -> None:
    with pytest.raises(ValueError, match="no rounds"):
        simulate([[], [[]]])
