"""Greedy speculative decoding is token-for-token the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch

PROMPTS = ["def parse(self, text):\n", "import os\nimport sys\n\n", "class Queue:\n    def "]


def target_greedy(target, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt_ids])
    out = target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
@pytest.mark.parametrize("draft_name", ["unrelated", "same", "noisy"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_output_equals_target_greedy(
    make_drafter, drafts, target, tokenizer, draft_name: str, gamma: int, pipeline: bool
) -> None:
    drafter = make_drafter(drafts[draft_name], gamma=gamma, pipeline=pipeline)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        result = drafter.generate(ids, max_new_tokens=24)
        assert result.tokens == target_greedy(target, tokenizer, ids, 24)
    if pipeline:
        accepted = sum(c.accepted for c in result.checks)
        rejected = sum(c.rejected for c in result.checks)
        undrafted = sum(c.rewound and not c.rejected for c in result.checks)
        assert all(c.window == gamma for c in result.checks)
        if draft_name == "same":  # a perfect draft: never corrected; what it had not drafted
            # yet when the verifier needed it, the verifier decoded alone
            assert rejected == 0 and accepted + undrafted == 24
            assert all(c.fed > 0 or c.alone for c in result.checks)
        if draft_name == "unrelated":
            assert rejected > 0
            # a first guess that is wrong costs the verifier no forward pass
            assert any(c.rejected and c.fed == 0 for c in result.checks)
    else:
        accepted = sum(r.accepted for r in result.rounds)
        drafted = sum(r.drafted for r in result.rounds)
        if draft_name == "same":
            assert accepted == drafted  # a perfect draft is always accepted
        if draft_name == "unrelated":
            assert accepted < drafted


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
def test_auto_gamma_also_matches_and_stays_in_bounds(
    make_drafter, drafts, target, tokenizer, pipeline: bool
) -> None:
    drafter = make_drafter(drafts["noisy"], gamma=None, pipeline=pipeline)
    ids = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    result = drafter.generate(ids, max_new_tokens=40)
    assert result.tokens == target_greedy(target, tokenizer, ids, 40)
    assert all(0 <= r.drafted <= 8 for r in result.rounds)
    assert all(1 <= c.window <= 8 for c in result.checks)
    assert bool(result.checks) == pipeline


def test_a_correction_to_token_0_is_taken_like_any_other(make_drafter, drafts) -> None:
    """Token id 0 is a token: a verdict replacing the first guess with it is valid."""
    from spec_decoding.drafter import _Flight

    drafter = make_drafter(drafts["noisy"], pipeline=True)
    flight = _Flight(confirmed=[], inflight=[7, 8], sent_at=[0.0, 0.0])
    progress = {"epoch": 0, "at": 0, "accepted": 0, "tokens": [0], "fed": 0, "verify_ms": 0.1}
    stats = drafter._take_progress(progress, flight, received=0.0, waited=False, window=4)
    assert stats.rejected and (flight.confirmed, flight.inflight, flight.epoch) == ([0], [], 1)
    bad = {**progress, "tokens": []}  # no correction and nothing passed: not a verdict
    with pytest.raises(ValueError, match="accepted 0 of"):
        drafter._take_progress(bad, _Flight(confirmed=[], inflight=[7]), 0.0, False, 4)


def test_a_verifier_that_waits_for_drafts_gives_the_same_tokens(
    make_drafter, drafts, target, tokenizer
) -> None:
    """`spec.decode_alone=false`: the verifier decodes nothing by itself; every token it
    commits is a draft it checked or a correction."""
    for name in ("same", "noisy"):
        drafter = make_drafter(drafts[name], gamma=3, pipeline=True, decode_alone=False)
        ids = tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
        result = drafter.generate(ids, max_new_tokens=24)
        assert result.tokens == target_greedy(target, tokenizer, ids, 24)
        assert result.alone == 0 and not any(c.alone for c in result.checks)


def test_an_opened_that_waited_out_the_drafters_prefill_is_no_round_trip(
    make_drafter, drafts, target, tokenizer, monkeypatch
) -> None:
    """Pipelined, the first drafts follow OPEN on the wire and OPENED is taken in among the
    verdicts. One already there at the drafter's first look may have waited out the drafter's
    own prefill: it dates nothing (counted, a slow draft prefill read as link time, and
    `gamma=auto` shrank its window at loopback)."""
    import threading
    import time

    from spec_decoding.cache import CachedDecoder

    prefill = CachedDecoder.prefill
    drafter_thread = threading.current_thread()  # the verifier serves from its own threads
    slept: list[tuple[float, float]] = []  # when each of the drafter's prefills slept

    def slow_prefill(self) -> None:
        if threading.current_thread() is drafter_thread:
            began = time.perf_counter()
            time.sleep(1.0)
            slept.append((began, time.perf_counter()))
        prefill(self)

    monkeypatch.setattr(CachedDecoder, "prefill", slow_prefill)
    drafter = make_drafter(drafts["noisy"], gamma=None, pipeline=True)
    samples: list[tuple[float, float]] = []  # (the round trip, when it was observed)
    observe = drafter.gamma.observe_rtt

    def observe_and_keep(seconds: float) -> None:
        samples.append((seconds, time.perf_counter()))
        observe(seconds)

    monkeypatch.setattr(drafter.gamma, "observe_rtt", observe_and_keep)
    ids = tokenizer(PROMPTS[2], add_special_tokens=False)["input_ids"]
    result = drafter.generate(ids, max_new_tokens=12)
    assert result.tokens == target_greedy(target, tokenizer, ids, 12)
    assert result.open_rtt_s is None and result.open_s >= 1.0
    # No round-trip sample holds the second the prefill slept: none, dated back from when it
    # was observed, began before the middle of a sleep it ended after. (One that held the
    # sleep began before it; an honest one carries drafts made after it, and a busy machine
    # only makes it seem to begin later: no bound on how long a loopback round trip takes.)
    assert slept  # (samples there may be none: a verdict found between steps dates nothing)
    held = [
        (rtt, seen)
        for rtt, seen in samples
        for began, ended in slept
        if seen - rtt <= (began + ended) / 2 and seen >= ended
    ]
    assert not held, (held, slept)


@pytest.mark.parametrize("pipeline", [False, True], ids=["rounds", "pipelined"])
def test_a_generation_of_nothing_is_refused_before_anything_is_sent(
    make_drafter, drafts, tokenizer, pipeline: bool
) -> None:
    """Pipelined, OPEN goes out unanswered: a refusal would surface only as a broken connection
    at the next generation. The drafter refuses it itself, and its session stays usable."""
    drafter = make_drafter(drafts["noisy"], pipeline=pipeline)
    ids = tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="at least 1"):
        drafter.generate(ids, max_new_tokens=0)
    assert len(drafter.generate(ids, max_new_tokens=4).tokens) == 4
