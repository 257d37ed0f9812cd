"""Whom a batch waits for: the sessions in flight (served, not back yet, not waiting on the
wire), at most a share of a forward's time, and never in vain twice for the same forward's
session or for one that turns round slower than the wait. The clock is injected and frozen:
a wait ends when its sessions come or the test moves the clock, whatever the machine's speed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from netproto import Connection, RemoteError
from spec_decoding.batching import BatchedTarget
from spec_decoding.cache import CachedDecoder
from spec_decoding.protocol import SpecMsg
from tests.spec_decoding.test_greedy import PROMPTS, target_greedy
from tests.spec_decoding.test_sessions import open_body

SAFETY_S = 120
"""How long a test waits for a thread before failing (a wrong policy waits forever on a
frozen clock; this ends the test instead)."""


class Clock:
    """A clock that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    return thread, out


def finished(thread: threading.Thread) -> bool:
    thread.join(timeout=SAFETY_S)
    return not thread.is_alive()


def until(condition: Callable[[], bool]) -> None:
    """Wait (real time) until `condition` holds: synchronisation, not a timing assertion."""
    deadline = time.monotonic() + SAFETY_S
    while not condition():
        assert time.monotonic() < deadline, "the batcher never got there"
        time.sleep(0.001)


@pytest.fixture
def two_sessions(target) -> tuple[BatchedTarget, Clock, CachedDecoder, CachedDecoder]:
    clock = Clock()
    batched = BatchedTarget(target, clock=clock)
    batched.sessions = 2  # (the verifier counts its connections)
    a = CachedDecoder(target, [5, 6, 7, 8, 9], batched=batched)
    b = CachedDecoder(target, [11, 12, 13], batched=batched)
    a.prefill()
    b.prefill()
    return batched, clock, a, b


def test_a_batch_waits_for_the_sessions_in_flight_once_it_has_run_short(
    two_sessions, target
) -> None:
    """Forwards of one session each, in turn (the state the last forward's row count kept):
    the next leader waits for the other session, which the last forward served, and they
    share the forward; each row is its session's own logits."""
    batched, _, a, b = two_sessions
    alone = {k: CachedDecoder(target, list(d.tokens)) for k, d in (("a", a), ("b", b))}
    for decoder in alone.values():
        decoder.prefill()
    a.extend([])
    batched.idle(a)  # a waits on the wire: b's forward runs without it
    b.extend([])
    for key, decoder in (("a", a), ("b", b)):
        decoder.commit([20])
        alone[key].extend([])
        alone[key].commit([20])
    assert batched.stats.by_rows == {1: 2}
    thread, out = in_thread(lambda: a.extend([21]))
    until(lambda: batched.stats.gather_waits == 1)  # a leads, waiting for b, in flight
    logits_b = b.extend([22])
    assert finished(thread)
    assert batched.stats.by_rows == {1: 2, 2: 1} and batched.stats.gather_missed == 0
    assert batched.stats.drafted == 2  # one drafted token each, the committed 20 before it
    for logits, key, drafted in ((out[0], "a", 21), (logits_b, "b", 22)):
        solo = alone[key].extend([drafted])
        torch.testing.assert_close(logits, solo, rtol=1e-4, atol=1e-5)
        assert torch.equal(logits.argmax(-1), solo.argmax(-1))


def test_a_slow_or_silent_session_costs_one_bounded_wait_at_most(two_sessions) -> None:
    """A session that does not come back is waited for until the wait's end (the test moves
    the clock past it), then not again until its next forward; one waiting on the wire is not
    waited for; one whose turnaround runs past the wait is not waited for either."""
    batched, clock, a, b = two_sessions
    a.extend([])  # a is in flight from here, and does not come
    thread, _ = in_thread(lambda: b.extend([]))
    until(lambda: batched.stats.gather_waits == 1)
    clock.now += 1.0  # past the wait's end: b goes alone
    assert finished(thread)
    assert batched.stats.gather_missed == 1 and batched.stats.by_rows == {1: 2}
    b.commit([30])
    thread, _ = in_thread(lambda: b.extend([]))  # a missed once: not waited for again
    assert finished(thread) and batched.stats.gather_waits == 1
    b.commit([31])
    batched.idle(b)  # b waits on the wire
    a.commit([32])
    thread, _ = in_thread(lambda: a.extend([]))  # a back after 1 s: its turnaround
    assert finished(thread) and batched.stats.gather_waits == 1
    thread, _ = in_thread(lambda: b.extend([]))  # a, in flight, turns round in 1 s: no wait
    assert finished(thread) and batched.stats.gather_waits == 1
    assert batched.stats.by_rows == {1: 5} and batched.stats.gather_missed == 1


def test_one_session_alone_never_waits(target) -> None:
    batched = BatchedTarget(target, clock=Clock())
    batched.sessions = 1
    decoder = CachedDecoder(target, [5, 6, 7], batched=batched)
    for token in (8, 9, 10):
        thread, _ = in_thread(lambda: decoder.extend([]))
        assert finished(thread)
        decoder.commit([token])
    assert batched.stats.gather_waits == 0 and batched.stats.by_rows == {1: 3}


def test_the_verifier_reports_its_batches_and_forgets_sessions_that_left(
    verifier_server, target, tokenizer
) -> None:
    """Two target-alone sessions at once: each gets the target's greedy text; STATS counts
    the forwards by their rows (rows = the sessions' tokens, none drafted); once both have
    closed, no leader waits for either."""
    verifier = verifier_server.verifier
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]

    def serve(prompt: list[int]) -> list[int]:
        with Connection.connect(*verifier_server.address) as conn:
            body = open_body(
                tokenizer, prompt=prompt, pipeline=True, max_new_tokens=10, drafting=False
            )
            conn.send_msg(SpecMsg.OPEN, body)
            tokens: list[int] = []
            while len(tokens) < 10:
                message = conn.recv(expect={SpecMsg.OPENED, SpecMsg.PROGRESS})
                if message.type == SpecMsg.PROGRESS:
                    tokens.extend(message.payload["tokens"])
            conn.send(SpecMsg.CLOSE)
        return tokens

    runs = [in_thread(partial(serve, p)) for p in prompts]
    for (thread, out), prompt in zip(runs, prompts, strict=True):
        assert finished(thread)
        assert out[0] == target_greedy(target, tokenizer, prompt, 10)
    until(lambda: verifier.active_sessions == 0)
    assert verifier.batched._away == {}  # left: nobody to wait for
    with (  # off by default: refused
        Connection.connect(*verifier_server.address) as conn,
        pytest.raises(RemoteError, match="STATS is off"),
    ):
        conn.request(SpecMsg.STATS, expect=SpecMsg.STATS_DONE)
    verifier.serve_stats = True  # spec.serve_stats=true, as the capacity bench sets it
    with Connection.connect(*verifier_server.address) as conn:
        stats = conn.request(SpecMsg.STATS, expect=SpecMsg.STATS_DONE).payload
    by_rows = {int(rows): n for rows, n in stats["by_rows"].items()}
    assert sum(by_rows.values()) == stats["forwards"]
    assert sum(rows * n for rows, n in by_rows.items()) == stats["rows"]
    # each session: the first prediction at OPEN, then one forward a token but the last
    assert stats["rows"] == stats["tokens"] == 2 * 10 and stats["drafted"] == 0
