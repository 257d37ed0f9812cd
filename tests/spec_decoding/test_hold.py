"""Holding for a batch (`spec.batch_hold_ms`): a session that consents lets the leader wait for
the other open sessions; the wait ends when they have all come, when the shortest consent runs
out, or at once when a session that consents to no hold is queued; a session alone, or one
that asked for none, is never held. The clock is injected and frozen: a wait ends when its
sessions come or the test moves the clock, whatever the machine's speed."""

from __future__ import annotations

import threading
from functools import partial

import pytest
import torch

from netproto import Connection
from spec_decoding.batching import BatchedTarget
from spec_decoding.cache import CachedDecoder
from spec_decoding.config import SpecConfig
from spec_decoding.drafter import Drafter
from spec_decoding.gamma import GammaController
from spec_decoding.protocol import SpecMsg
from tests.spec_decoding.test_gather import Clock, finished, in_thread, until
from tests.spec_decoding.test_greedy import PROMPTS, target_greedy


@pytest.fixture
def three(target) -> tuple[BatchedTarget, Clock, list[CachedDecoder]]:
    clock = Clock()
    batched = BatchedTarget(target, clock=clock)
    batched.sessions = 3  # (the verifier counts its connections)
    decoders = [
        CachedDecoder(target, prompt, batched=batched)
        for prompt in ([5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24])
    ]
    for decoder in decoders:
        decoder.prefill()
    return batched, clock, decoders


def test_sessions_that_consent_are_held_until_the_others_come_and_share_one_forward(
    three, target
) -> None:
    """Each row is still its session's own logits."""
    batched, _, decoders = three
    for decoder in decoders:
        batched.hold(decoder, 0.02)
    alone = [CachedDecoder(target, list(d.tokens)) for d in decoders]
    for decoder in alone:
        decoder.prefill()
    first, out_first = in_thread(lambda: decoders[0].extend([]))
    until(lambda: batched.stats.hold_waits == 0 and len(batched._queue) == 1)
    second, out_second = in_thread(lambda: decoders[1].extend([]))
    until(lambda: len(batched._queue) == 2)
    assert first.is_alive() and batched.stats.forwards == 0  # held: nothing ran yet
    logits_third = decoders[2].extend([])
    assert finished(first) and finished(second)
    assert batched.stats.by_rows == {3: 1} and batched.stats.hold_waits == 1
    for logits, solo in zip((out_first[0], out_second[0], logits_third), alone, strict=True):
        expected = solo.extend([])
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def test_a_hold_ends_when_its_consent_runs_out(three) -> None:
    batched, clock, decoders = three
    batched.hold(decoders[0], 0.02)
    batched.hold(decoders[1], 0.02)  # (a session it may wait for)
    thread, _ = in_thread(lambda: decoders[0].extend([]))
    until(lambda: len(batched._queue) == 1)
    assert thread.is_alive()  # held: the frozen clock has not reached its consent's end
    with batched._cond:  # (the leader lets go of the lock only in its wait: it is waiting;
        clock.now += 0.021  # a wait on the real clock would end by itself: wake it now)
        batched._cond.notify_all()
    assert finished(thread)
    assert batched.stats.by_rows == {1: 1} and batched.stats.hold_waits == 1


def test_a_session_that_asked_for_no_hold_is_never_held_and_ends_anothers_hold(three) -> None:
    batched, _, decoders = three
    batched.hold(decoders[0], 0.02)
    batched.hold(decoders[2], 0.02)
    thread, _ = in_thread(lambda: decoders[1].extend([]))  # no consent: runs at once
    assert finished(thread)
    assert batched.stats.hold_waits == 0 and batched.stats.by_rows == {1: 1}
    batched.idle(decoders[1])  # on the wire: no leader waits for it as in flight
    held, _ = in_thread(lambda: decoders[0].extend([]))
    until(lambda: len(batched._queue) == 1)
    decoders[1].commit([40])
    decoders[1].extend([])  # queued beside the held one, consenting to nothing: both go now
    assert finished(held)
    assert batched.stats.by_rows == {1: 1, 2: 1} and batched.stats.hold_waits == 1


def test_a_session_leaving_ends_a_hold_for_it_and_forgets_its_consent(three) -> None:
    batched, _, decoders = three
    for decoder in decoders:
        batched.hold(decoder, 0.02)
    thread, _ = in_thread(lambda: decoders[0].extend([]))
    until(lambda: len(batched._queue) == 1)
    batched.idle(decoders[2], leaving=True)
    batched.sessions = 2  # (the verifier's count falls as the connection ends)
    decoders[1].extend([])
    assert finished(thread)
    assert batched.stats.by_rows == {2: 1}
    batched.idle(decoders[1], leaving=True)
    batched.sessions = 1
    decoders[0].commit([41])
    decoders[0].extend([])  # alone now: never held
    assert batched.stats.hold_waits == 1 and id(decoders[2]) not in batched._holds


def test_only_sessions_that_consented_are_waited_for(three) -> None:
    """Connections with nothing coming (an idle pooled drafter, a session between
    generations, a STATS probe) and sessions that asked for no hold are counted open, but a
    held session waits only for the others that consented: alone in consenting, it is never
    held, on a clock that never moves."""
    batched, _, decoders = three
    batched.hold(decoders[0], 0.02)
    decoders[0].extend([])  # decoders 1 and 2 are open and silent: no wait
    assert batched.stats.hold_waits == 0 and batched.stats.by_rows == {1: 1}
    batched.hold(decoders[1], 0.02)
    decoders[0].commit([50])
    batched.idle(decoders[0])
    thread, _ = in_thread(lambda: decoders[0].extend([]))
    until(lambda: len(batched._queue) == 1)
    assert thread.is_alive()  # held for 1, which consented
    batched.hold(decoders[1], 0.0)  # 1 withdraws: nobody left to wait for
    assert finished(thread)
    assert batched.stats.hold_waits == 1 and batched.stats.by_rows == {1: 2}


def served(batched: BatchedTarget, *sessions: CachedDecoder) -> None:
    """Each of `sessions` commits a token and waits on the wire for its next DRAFT."""
    for decoder in sessions:
        decoder.commit([60])
        batched.idle(decoder)


def in_step(batched: BatchedTarget, clock: Clock, a: CachedDecoder, b: CachedDecoder) -> None:
    """`a` and `b` consent to 20 ms holds and come together at 0 and 0.1 s, `a` held for `b`
    each time: both cycles measured, 100 ms."""
    batched.hold(a, 0.02)
    batched.hold(b, 0.02)
    for at in (0.0, 0.1):
        clock.now = at
        first, _ = in_thread(lambda: a.extend([]))
        until(lambda: len(batched._queue) == 1)
        b.extend([])
        assert finished(first)
        served(batched, a, b)


def test_a_hold_waits_only_for_sessions_due_within_it_and_drifts_towards_those_due_soon_after(
    three,
) -> None:
    """Sessions in DRAFT rounds: the batcher learns each one's cycle (from its forward's result
    to its next request, the wire's round trip included). A leader holds for a consenting
    session only if it is due back within the consent: one that fell a round's fraction out
    of step is not waited for every round in vain (each side holding for the other shifted
    both alike, and the split stayed). Where the other is due within half its cycle after
    the consent, the leader is held its whole consent anyway, so the two come back closer."""
    batched, clock, decoders = three
    a, b = decoders[0], decoders[1]
    in_step(batched, clock, a, b)
    assert batched.stats.by_rows == {2: 2}
    clock.now = 0.2  # a comes; b is due now too: a is held for it
    first, _ = in_thread(lambda: a.extend([]))
    until(lambda: len(batched._queue) == 1)
    with batched._cond:  # (the leader lets go of the lock only in its wait: it is waiting)
        clock.now = 0.221  # b is late: a's consent runs out, it goes alone
        batched._cond.notify_all()
    assert finished(first)
    served(batched, a)
    holds = batched.stats.hold_waits
    clock.now = 0.25  # b, 29 ms after a: a is due at 0.321, past b's consent and half a
    late, _ = in_thread(lambda: b.extend([]))  # cycle after it: b is not held, the clock
    assert finished(late)  # never moves (it was, for a, until the clock ran past its consent)
    served(batched, b)
    assert batched.stats.hold_waits == holds and batched.stats.by_rows == {2: 2, 1: 2}
    clock.now = 0.32  # a comes; b is due at 0.36 (0.25 + its cycle, 110 ms): not by a's
    first, _ = in_thread(lambda: a.extend([]))  # consent's end, 0.34, but soon after it
    until(lambda: len(batched._queue) == 1)
    with batched._cond:
        clock.now = 0.341
        batched._cond.notify_all()
    assert finished(first)
    assert batched.stats.hold_waits == holds + 1  # held its whole consent, alone
    assert batched.stats.held_s == pytest.approx(0.021 + 0.021, abs=1e-9)


def test_a_session_a_hold_waited_for_in_vain_is_not_waited_for_again_until_it_is_back(
    three,
) -> None:
    """A consenting session that stalls (its client paused, or opened and silent) costs the
    others one hold, not one on every forward for as long as it stalls."""
    batched, clock, decoders = three
    a, b = decoders[0], decoders[1]
    in_step(batched, clock, a, b)
    clock.now = 0.2  # a comes; b is due: a is held for it
    first, _ = in_thread(lambda: a.extend([]))
    until(lambda: len(batched._queue) == 1)
    with batched._cond:  # (the leader lets go of the lock only in its wait: it is waiting)
        clock.now = 0.221  # b stalls: a's consent runs out
        batched._cond.notify_all()
    assert finished(first)
    served(batched, a)
    clock.now = 0.321  # a's next round; b, overdue, was waited for in vain: a goes at once
    again, _ = in_thread(lambda: a.extend([]))
    assert finished(again)
    assert batched.stats.hold_waits == 3 and batched.stats.by_rows == {2: 2, 1: 2}
    served(batched, a)
    clock.now = 0.33  # b is back: waited for again from its next round
    b.extend([])
    served(batched, b)
    clock.now = 0.421  # a comes; b, back at 0.33, is due at 0.43: a is held for it
    held, _ = in_thread(lambda: a.extend([]))
    until(lambda: len(batched._queue) == 1)
    b.extend([])
    assert finished(held)
    assert batched.stats.by_rows == {2: 3, 1: 3} and batched.stats.hold_waits == 4


@pytest.mark.parametrize("bad", [-0.001, float("inf"), float("nan")])
def test_a_hold_must_be_a_finite_time(target, bad: float) -> None:
    batched = BatchedTarget(target)
    decoder = CachedDecoder(target, [1, 2], batched=batched)
    with pytest.raises(ValueError, match="finite number of seconds"):
        batched.hold(decoder, bad)


def test_spec_batch_hold_ms_is_bounded() -> None:
    with pytest.raises(ValueError, match=r"spec\.batch_hold_ms"):
        SpecConfig(batch_hold_ms=-1)
    with pytest.raises(ValueError, match=r"spec\.batch_hold_ms"):
        SpecConfig(batch_hold_ms=float("nan"))
    assert SpecConfig(batch_hold_ms=20).batch_hold_ms == 20


def test_drafters_in_rounds_that_consent_share_the_verifiers_forwards(
    verifier_server, target, tokenizer, drafts
) -> None:
    """Two drafters in DRAFT rounds, each consenting to be held: each gets the target's greedy
    text, and the verifier held forwards for them (both connections open before either
    drafts, so the first request always finds the other session open)."""
    verifier = verifier_server.verifier
    verifier.serve_stats = True
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]
    conns = [Connection.connect(*verifier_server.address) for _ in prompts]
    until(lambda: verifier.active_sessions == 2)
    drafters = [
        Drafter(
            drafts["noisy"],
            tokenizer,
            conn,
            gamma=GammaController(fixed=3, max_gamma=8),
            pipeline=False,
            batch_hold_ms=1000,
        )
        for conn in conns
    ]
    go = threading.Barrier(2)

    def generate(drafter: Drafter, prompt: list[int]) -> list[int]:
        go.wait()
        return drafter.generate(prompt, max_new_tokens=12).tokens

    runs = [in_thread(partial(generate, d, p)) for d, p in zip(drafters, prompts, strict=True)]
    for (thread, out), prompt in zip(runs, prompts, strict=True):
        assert finished(thread)
        assert out[0] == target_greedy(target, tokenizer, prompt, 12)
    with Connection.connect(*verifier_server.address) as conn:
        stats = conn.request(SpecMsg.STATS, expect=SpecMsg.STATS_DONE).payload
    assert stats["hold_waits"] >= 1
    for conn in conns:
        conn.close()
