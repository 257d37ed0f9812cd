"""The cost models behind `gamma=auto` and the predicted speedup."""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
import pytest

from spec_decoding.gamma import (
    GammaController,
    PipelineModel,
    fit_verify_costs,
    simulate_pipeline,
)


def test_a_perfect_draft_runs_at_the_drafter_speed_when_the_verifier_keeps_up() -> None:
    model = PipelineModel(
        alpha=0.9999, draft_s=1e-3, verify_base_s=2e-4, verify_per_token_s=1e-5, one_way_s=1e-4
    )
    assert model.tokens_per_second(8) == pytest.approx(1000, rel=0.02)


def test_a_useless_draft_gives_one_token_per_epoch() -> None:
    """Every first guess wrong: each epoch is the correction's forward, or the next guess's
    trip from the drafter, whichever ends later."""
    d, h, verify = 1e-3, 2e-3, 3e-3
    model = PipelineModel(
        alpha=0.0, draft_s=d, verify_base_s=verify, verify_per_token_s=0.0, one_way_s=h
    )
    epoch_s = max(verify, h + d / 2 + d + h)
    assert model.tokens_per_second(4) == pytest.approx(1 / epoch_s)


def test_a_longer_link_wants_a_wider_window() -> None:
    """With a verifier that pays for every token it runs, a near one wants a narrow window
    (tokens past a wrong one cost it time); a far one needs a wide window all the same."""

    def model(one_way_s: float) -> PipelineModel:
        return PipelineModel(
            alpha=0.6,
            draft_s=1e-3,
            verify_base_s=1e-3,
            verify_per_token_s=2e-3,
            one_way_s=one_way_s,
        )

    near, far = model(1e-4).best_window(32), model(10e-3).best_window(32)
    assert near <= 4
    assert model(1e-4).tokens_per_second(near) > 1.1 * model(1e-4).tokens_per_second(32)
    assert far >= 16  # 20 ms of round trip hold twenty 1 ms draft steps


def test_of_equal_windows_the_widest_is_chosen() -> None:
    """A cheap verifier on a near link: every window past a few is as good as the next."""
    model = PipelineModel(
        alpha=0.89, draft_s=1e-3, verify_base_s=2e-3, verify_per_token_s=3e-4, one_way_s=2e-4
    )
    assert model.tokens_per_second(8) == pytest.approx(model.tokens_per_second(32), rel=0.01)
    assert model.best_window(32) == 32


def test_pipelined_controller_picks_the_window_from_its_measurements() -> None:
    controller = GammaController(fixed=None, max_gamma=32, pipelined=True)
    assert controller.next_gamma() == 16  # nothing measured yet: the prior
    for _ in range(16):
        controller.observe_draft(1e-3)
        controller.observe_checks(accepted=3, rejected=True)
        controller.observe_verify(1, 2.0e-3)
        controller.observe_verify(4, 2.6e-3)
        controller.observe_rtt(20e-3)
    model = controller.pipeline_model()
    assert model.alpha == pytest.approx((16 * 3 + 1) / (16 * 4 + 2))  # Laplace's rule
    assert model._verify_s(1) == pytest.approx(2.0e-3)
    assert model._verify_s(4) == pytest.approx(2.6e-3)
    assert model.one_way_s == pytest.approx(10e-3)
    assert controller.next_gamma() == 16  # chosen between generations, not mid-stream
    controller.rechoose()
    assert controller.next_gamma() == model.best_window(32) > 4
    for _ in range(16):  # the same link and pair: nothing moved, nothing to simulate again
        controller.observe_checks(accepted=3, rejected=True)
    controller._choice = 3  # (were it simulated again, this would go)
    controller.rechoose()
    assert controller.next_gamma() == 3
    for _ in range(32):  # the link slowed down: chosen again
        controller.observe_rtt(60e-3)
    controller.rechoose()
    assert controller.next_gamma() == controller.pipeline_model().best_window(32)


def test_a_streak_on_one_prompt_does_not_set_the_next_prompts_draft_length() -> None:
    controller = GammaController(fixed=None, max_gamma=32)
    for _ in range(32):  # a loop the draft predicts perfectly: longer drafts pay
        controller.update(drafted=8, accepted=8, draft_s=8e-3, verify_s=2.5e-3, round_s=11e-3)
    assert controller.next_gamma() > 16
    controller.new_text()
    for _ in range(4):
        controller.update(drafted=4, accepted=1, draft_s=4e-3, verify_s=2.3e-3, round_s=6.5e-3)
    assert controller.next_gamma() <= 4


def _realistic(one_way_s: float, *, alpha: float = 0.72, alone: bool = False) -> PipelineModel:
    """The bench's realistic pair on the 2-core EPYC: c ~ 0.1, 0.8 ms per extra token."""
    return PipelineModel(
        alpha=alpha,
        draft_s=1e-3,
        verify_base_s=8.5e-3,
        verify_per_token_s=0.8e-3,
        one_way_s=one_way_s,
        alone=alone,
    )


@pytest.mark.parametrize("one_way_ms", [0.1, 2, 10, 50])
@pytest.mark.parametrize("window", [3, 8, 32])
def test_the_simulated_code_path_agrees_with_the_epoch_model(
    one_way_ms: float, window: int
) -> None:
    """Two derivations of a verifier that waits for drafts: the epoch model (an average over
    where the first wrong token falls) and the event-by-event simulation."""
    model = _realistic(one_way_ms / 1e3)
    simulated = np.mean([simulate_pipeline(model, window, alone=False, seed=s) for s in range(8)])
    assert simulated == pytest.approx(model.tokens_per_second(window), rel=0.12)


@pytest.mark.parametrize("one_way_ms", [0.1, 2, 10, 50, 200])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9])
def test_a_verifier_that_decodes_alone_is_never_slower_than_the_target_alone(
    one_way_ms: float, alpha: float
) -> None:
    """Whatever the link and the draft, any window: at least the target's own rate (one
    token per single-token forward), less the waits for drafts of a live stream (patience)."""
    model = _realistic(one_way_ms / 1e3, alpha=alpha, alone=True)
    alone_rate = 1 / model._verify_s(1)
    for window in (1, 4, 16, 32):
        assert model.tokens_per_second(window) >= 0.95 * alone_rate
    waiting = np.mean(  # the same simulation, the verifier waiting for drafts
        [simulate_pipeline(model, 32, alone=False, tokens=300, seed=s) for s in range(2)]
    )
    assert model.tokens_per_second(32) >= 0.98 * waiting  # never worse than waiting
    if one_way_ms >= 10 and alpha <= 0.5:  # where waiting costs the most, it pays most
        assert model.tokens_per_second(32) > 1.5 * waiting


def bench_like(one_way_s: float, **branches) -> PipelineModel:
    """The realistic pair's measured costs on the 2-core bench machine (c = 0.06)."""
    return PipelineModel(
        alpha=0.71,
        draft_s=6e-4,
        verify_base_s=9.7e-3,
        verify_per_token_s=9e-4,
        one_way_s=one_way_s,
        alone=True,
        **branches,
    )


@pytest.mark.parametrize("one_way_s", [3e-4, 11e-3])
def test_branches_pay_in_the_model_only_where_their_roots_are_hit(one_way_s: float) -> None:
    """A branch spares the verifier a forward (loopback: the correction's own) or a round
    trip alone (10 ms) only when its root is the verifier's token; roots never hit leave
    the drafter's extra steps and nothing gained."""

    def rate(model: PipelineModel) -> float:  # at the window `auto` would choose
        return model.tokens_per_second(model.best_window(32))

    plain = rate(bench_like(one_way_s))
    hit = rate(bench_like(one_way_s, branch_depth=3, branch_hit=0.9))
    missed = rate(bench_like(one_way_s, branch_depth=3, branch_hit=0.0))
    assert hit > 1.08 * plain
    assert missed == pytest.approx(plain, rel=0.06)


def test_auto_branches_only_where_the_model_says_they_pay() -> None:
    def controller(hit: bool, rtt_s: float) -> GammaController:
        gamma = GammaController(fixed=None, max_gamma=32, pipelined=True, alone=True)
        gamma.branch_depth = 4
        for i in range(32):
            gamma.observe_checks(accepted=2, rejected=True)
            gamma.observe_draft(6e-4)
            gamma.observe_verify(1 + i % 4, 9.7e-3 + 9e-4 * (i % 4))
            gamma.observe_rtt(rtt_s)
            gamma.observe_root(hit)
        return gamma

    mid_stream = controller(hit=True, rtt_s=0.022)
    assert mid_stream.branch_plan() == 0  # chosen between generations, not mid-stream
    for hit, rtt_s, branches in ((False, 0.022, False), (True, 0.022, True), (True, 6e-4, True)):
        gamma = controller(hit=hit, rtt_s=rtt_s)
        gamma.rechoose()
        assert (gamma.branch_plan() >= 2) == branches, (hit, rtt_s)
    fixed = GammaController(fixed=6, max_gamma=32, pipelined=True)
    fixed.branch_depth = 3
    assert fixed.branch_plan() == 3  # a fixed setting is taken as it is
    fixed.branch_depth = 0
    assert fixed.branch_plan() == 0


def test_clustered_wrong_guesses_keep_the_rate_and_lengthen_the_runs() -> None:
    """With `alpha_after_wrong`, the simulated guesses are right at `alpha` in the long run
    and at `alpha_after_wrong` just after a wrong one; the runs of right guesses are longer,
    and a pipeline streams through more of them at once."""
    from spec_decoding.gamma import _guesses

    model = bench_like(11e-3, alpha_after_wrong=0.55)
    right = _guesses(model, np.random.default_rng(0).random(200_000))
    after = right[1:][~right[:-1]]
    assert right.mean() == pytest.approx(0.71, abs=0.01)
    assert after.mean() == pytest.approx(0.55, abs=0.01)
    independent = bench_like(11e-3)
    assert model.tokens_per_second(24) > 1.03 * independent.tokens_per_second(24)


def test_the_controller_measures_the_chance_after_a_wrong_guess() -> None:
    gamma = GammaController(fixed=None, max_gamma=32, pipelined=True, alone=True)
    for _ in range(30):  # each check: two right then a wrong one, then one wrong alone
        gamma.observe_checks(accepted=2, rejected=True)
        gamma.observe_checks(accepted=0, rejected=True)
    # after a wrong guess: the next check's first guess, right in half of them
    assert gamma.pipeline_model().alpha_after_wrong == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    "curve",
    [
        {1: 9.0, 2: 11.7, 3: 13.2, 5: 14.9, 9: 16.5, 17: 18.7, 33: 22.4},  # the bench CPU's
        {n: 2.0 + 0.8 * n for n in (1, 2, 3, 5, 9, 17)},  # compute-bound: a line
        {n: 5.7 for n in (1, 3, 5, 9, 17)},  # a GPU: flat
    ],
    ids=["memory_bound", "compute_bound", "flat"],
)
def test_the_verify_cost_fit_follows_the_measured_curve(curve: dict[int, float]) -> None:
    """Forwards of a few tokens predict the cost of many: the fit keeps to the curve wherever
    it was measured and beyond (fitted on up to 9 tokens, checked up to 33)."""
    seen = [(n, ms / 1e3) for n, ms in curve.items() if n <= 9 for _ in range(3)]
    base, per_token, per_doubling = fit_verify_costs(seen)
    assert min(base, per_token, per_doubling) >= 0
    model = bench_like(0.0, verify_per_doubling_s=per_doubling)
    model.verify_base_s, model.verify_per_token_s = base, per_token
    for n, ms in curve.items():
        assert model._verify_s(n) * 1e3 == pytest.approx(ms, rel=0.1), n


def test_the_verify_cost_fit_ignores_what_is_no_measurement() -> None:
    """NaN, infinite or negative times and impossible sizes are dropped (a NaN fed to the
    simulation would never let it end); a base that fits negative is dropped and the rest
    refitted, not clamped to 0 under the old slope."""
    clean = [(1, 9e-3), (2, 11.7e-3), (5, 14.9e-3), (9, 16.5e-3)]
    dirty = [*clean, (3, float("nan")), (4, float("inf")), (2, -1.0), (0, 1.0), (10**400, 1.0)]
    assert fit_verify_costs(dirty) == fit_verify_costs(clean)
    through_zero = [(n, 0.01 * n - 0.004) for n in (1, 2, 4, 8, 16)]
    base, per_token, per_doubling = fit_verify_costs(through_zero)
    assert base == 0 and min(per_token, per_doubling) >= 0
    model = bench_like(0.0, verify_per_doubling_s=per_doubling)
    model.verify_base_s, model.verify_per_token_s = base, per_token
    assert model._verify_s(16) == pytest.approx(0.156, rel=0.05)


@pytest.mark.parametrize(("alpha", "after_wrong"), [(0.3, 0.6), (0.2, 0.9), (0.7, 0.0), (0.7, 1.0)])
def test_clustered_guesses_keep_the_mean_whatever_the_measured_rate(
    alpha: float, after_wrong: float
) -> None:
    from spec_decoding.gamma import _guesses

    model = bench_like(0.0, alpha_after_wrong=after_wrong)
    model.alpha = alpha
    right = _guesses(model, np.random.default_rng(1).random(100_000))
    assert right.mean() == pytest.approx(alpha, abs=0.02)


def test_gated_branches_cost_only_where_they_are_drafted() -> None:
    """Branching only the unsure tokens (a fifth of them, holding 60% of the wrong ones)
    keeps most of what branches save and little of what they cost: with a draft step that
    makes branching every token a loss, the gated branches simulate faster than both."""
    window = 16

    def rate(**branches) -> float:
        model = replace(bench_like(11e-3, **branches), draft_s=2.5e-3)
        return statistics.mean(
            simulate_pipeline(model, window, alone=True, seed=s) for s in range(6)
        )

    plain = rate()
    every = rate(branch_depth=3, branch_hit=0.45)
    gated = rate(branch_depth=3, branch_hit=0.45, branch_share=0.2, branch_cover=0.6)
    assert every < plain < gated


def test_the_controller_measures_which_tokens_it_branches() -> None:
    gamma = GammaController(fixed=None, max_gamma=32, pipelined=True, alone=True)
    gamma.branch_depth = 3
    for _ in range(20):
        gamma.observe_flat(True)  # every drafted token branched so far: not gated
    assert (gamma.branch_share, gamma.branch_cover) == (1.0, 1.0)  # not gated: every token
    gamma = GammaController(fixed=None, max_gamma=32, pipelined=True, alone=True)
    gamma.branch_depth = 3
    for i in range(98):
        gamma.observe_flat(i % 4 == 0)  # a quarter of the drafted tokens unsure
    for i in range(48):
        gamma.observe_root(None if i % 3 == 0 else i % 2 == 0)  # a third wrong where sure
    assert gamma.branch_share == pytest.approx(26 / 100)  # Laplace's rule: 25 of 98
    assert gamma.branch_cover == pytest.approx(33 / 50)  # 32 of 48
    assert gamma.pipeline_model().branch_share == gamma.branch_share


def test_the_gated_simulation_branches_the_shares_it_is_given() -> None:
    from spec_decoding.gamma import _branched, _guesses

    model = PipelineModel(alpha=0.75, draft_s=1e-3, verify_base_s=9e-3, verify_per_token_s=9e-4,
                          one_way_s=0.01, branch_depth=3, branch_share=0.25,
                          branch_cover=0.6)  # fmt: skip
    rng = np.random.default_rng(0)
    right = _guesses(model, rng.random(200_000))
    branched = _branched(model, right, rng)
    assert branched.mean() == pytest.approx(0.25, abs=0.01)
    assert branched[~right].mean() == pytest.approx(0.6, abs=0.01)
    ungated = replace(model, branch_share=1.0, branch_cover=1.0)
    assert _branched(ungated, right, rng).all()
