"""The cost models behind `gamma=auto` and the predicted speedup, and checking in pieces."""

from __future__ import annotations

import pytest
import torch

from spec_decoding.gamma import GammaController, PipelineModel
from spec_decoding.sampling import speculative_verdict


def test_checking_a_draft_in_pieces_draws_what_checking_it_at_once_draws() -> None:
    """The pipelined verifier checks a first guess alone, then the rest after a forward pass:
    with the same random stream it must reach the same verdict as one check of them all."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(200):
        k, vocab = 4, 6
        p = torch.softmax(torch.randn(k + 1, vocab, generator=rng), dim=-1)
        q = torch.softmax(torch.randn(k, vocab, generator=rng), dim=-1)
        draft = [int(torch.multinomial(q[i], 1, generator=rng)) for i in range(k)]
        whole = speculative_verdict(
            p, q, draft, generator=torch.Generator().manual_seed(trial), bonus=False
        )
        stream = torch.Generator().manual_seed(trial)
        first = speculative_verdict(p[:1], q[:1], draft[:1], generator=stream, bonus=False)
        if first[1] is None:
            rest = speculative_verdict(p[1:], q[1:], draft[1:], generator=stream, bonus=False)
            pieces = (1 + rest[0], rest[1])
        else:
            pieces = first
        assert pieces == whole


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
    assert controller.next_gamma() == 4  # nothing measured yet
    for _ in range(16):
        controller.observe_draft(1e-3)
        controller.observe_checks(accepted=3, rejected=True)
        controller.observe_verify(1, 2.0e-3)
        controller.observe_verify(4, 2.6e-3)
        controller.observe_rtt(20e-3)
    model = controller.pipeline_model()
    assert model.alpha == pytest.approx((16 * 3 + 1) / (16 * 4 + 2))  # Laplace's rule
    assert model.verify_per_token_s == pytest.approx(2e-4)
    assert model.one_way_s == pytest.approx(10e-3)
    assert controller.next_gamma() == model.best_window(32) > 4


def test_a_streak_on_one_prompt_does_not_set_the_next_prompts_draft_length() -> None:
    controller = GammaController(fixed=None, max_gamma=32)
    for _ in range(32):  # a loop the draft predicts perfectly: longer drafts pay
        controller.update(drafted=8, accepted=8, draft_s=8e-3, verify_s=2.5e-3, round_s=11e-3)
    assert controller.next_gamma() > 16
    controller.new_text()
    for _ in range(4):
        controller.update(drafted=4, accepted=1, draft_s=4e-3, verify_s=2.3e-3, round_s=6.5e-3)
    assert controller.next_gamma() <= 4
