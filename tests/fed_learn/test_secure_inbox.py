"""The secure round's inbox: what the clients' sessions hand in while the round waits for a
step is what the step gets, whichever thread brought it and whenever; a client's next step
sent early waits for that step; a session that ends stops the wait for its client."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from fed_learn import secagg
from fed_learn.protocol import FedMsg
from fed_learn.secure_inbox import DIGESTED_BYTES, InputDigests, SecureInbox
from tests.clocks import HANG_GUARD_S

FAR = 10 * HANG_GUARD_S  # a deadline no passing test reaches


@pytest.fixture(autouse=True)
def no_polling(monkeypatch) -> None:
    """The wait also wakes every WAKE_S and to report what it waits for: made longer than
    the hang guard, so only the arrivals' own wake-ups can end a wait in these tests (a lost
    one hangs the gather, and `gathered` fails instead of a poll rescuing it)."""
    for name in ("WAKE_S", "REPORT_FIRST_S", "REPORT_EVERY_S"):
        monkeypatch.setattr(f"fed_learn.secure_inbox.{name}", FAR)


def gathered(inbox: SecureInbox, *args: Any, **kwargs: Any) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(inbox.gather(*args, **kwargs)))
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the wait was never woken by the arrivals"
    return out[0]


def test_a_step_gets_every_message_the_sessions_hand_in_while_it_waits() -> None:
    inbox = SecureInbox()
    clients = list(range(20))
    inbox.open({c: 100 + c for c in clients})
    started = threading.Event()

    def sessions() -> None:
        started.wait()
        for c in clients:  # one session thread's worth each, in turn
            assert inbox.offer(c, FedMsg.SA_KEYS, {"from": c}, task=100 + c)
            inbox.offer(c, FedMsg.SA_SHARES, {"early": c}, task=100 + c)  # its next step, early

    thread = threading.Thread(target=sessions)
    thread.start()
    started.set()
    got = gathered(inbox, FedMsg.SA_KEYS, clients, inbox.clock() + FAR, what="keys")
    thread.join()
    assert got == {c: {"from": c} for c in clients}
    # the early next-step messages were kept for that step, not dropped
    nxt = inbox.gather(FedMsg.SA_SHARES, clients, inbox.clock() + FAR, what="shares")
    assert nxt == {c: {"early": c} for c in clients}


def test_a_session_that_ends_stops_the_wait_for_its_client() -> None:
    inbox = SecureInbox()
    inbox.open({1: 7, 2: 8})
    assert inbox.offer(1, FedMsg.SA_KEYS, {"c": 1}, task=7)
    leaving = threading.Thread(target=inbox.leave, args=(2,))
    leaving.start()  # client 2's session ends while the round waits for its keys
    got = gathered(inbox, FedMsg.SA_KEYS, [1, 2], inbox.clock() + FAR, what="keys")
    leaving.join()
    assert got == {1: {"c": 1}}


def test_a_message_for_another_task_or_twice_is_not_taken() -> None:
    inbox = SecureInbox()
    inbox.open({1: 7})
    assert not inbox.offer(1, FedMsg.SA_KEYS, {"c": 0}, task=6)  # an old round's task
    assert inbox.offer(1, FedMsg.SA_KEYS, {"c": 1}, task=7)
    assert not inbox.offer(1, FedMsg.SA_KEYS, {"c": 2}, task=7)  # once per step
    assert inbox.gather(FedMsg.SA_KEYS, [1], inbox.clock() + FAR, what="keys") == {1: {"c": 1}}


def _masked(seed: int, entries: int = 16_385) -> np.ndarray:
    """A masked input as an honest client's looks: uniform uint64s (its self-mask)."""
    return np.random.default_rng(seed).integers(0, 2**64, entries, dtype=np.uint64)


def test_a_masked_input_seen_before_is_refused_whole_or_spliced_and_fresh_ones_are_not() -> None:
    """The replay check hashes an input's first DIGESTED_BYTES: a whole replay is refused
    by name, and so is an old input's head with a new tail; a hundred rounds of a hundred
    fresh inputs pass (as inputs of uniform entries do), short inputs too."""
    digests = InputDigests()
    for round_index in range(100):
        for client in range(100):
            digests.admit(client, round_index, _masked(round_index * 100 + client, 300))
    old = _masked(10_007)
    digests.admit(3, 0, old)
    with pytest.raises(secagg.Refused, match="replays the masked input client 3 sent in round 1"):
        digests.admit(5, 1, old.copy())
    spliced = _masked(10_008)
    spliced[: DIGESTED_BYTES // 8] = old[: DIGESTED_BYTES // 8]
    with pytest.raises(secagg.Refused, match="client 3 sent in round 1"):
        digests.admit(6, 1, spliced)
    tail_only = old.copy()
    tail_only[0] ^= np.uint64(1)  # one bit of the head differs: not the input seen before
    digests.admit(6, 1, tail_only)
    with pytest.raises(secagg.Refused, match="client 6 sent in round 2"):
        digests.admit(9, 2, tail_only[::-1][::-1])  # a strided view of it, hashed in C order


def test_within_a_round_only_a_whole_copy_is_a_replay() -> None:
    """A client that reads another's masked input in flight can send its head first, ahead of
    the whole: the honest input that follows is still taken (a shared head within a round
    names no one), while a whole copy of one taken this round is refused by name."""
    digests = InputDigests()
    honest = _masked(20_001)
    racer = _masked(20_002)
    racer[: DIGESTED_BYTES // 8] = honest[: DIGESTED_BYTES // 8]  # the head seen in flight
    digests.admit(4, 0, racer)
    digests.admit(1, 0, honest)  # not refused: its head came first from client 4
    with pytest.raises(secagg.Refused, match="client 1 sent in round 1"):
        digests.admit(2, 0, honest.copy())
    with pytest.raises(secagg.Refused, match="client 4 sent in round 1"):
        digests.admit(3, 1, honest)  # a later round: the head alone is a replay
