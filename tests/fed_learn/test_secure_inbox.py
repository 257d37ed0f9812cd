"""The secure round's inbox: what the clients' sessions hand in while the round waits for a
step is what the step gets, whichever thread brought it and whenever; a client's next step
sent early waits for that step; a session that ends stops the wait for its client."""

from __future__ import annotations

import threading

from fed_learn.protocol import FedMsg
from fed_learn.secure_inbox import SecureInbox

FAR = 600.0  # a deadline no passing test reaches


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
    got = inbox.gather(FedMsg.SA_KEYS, clients, inbox.clock() + FAR, what="keys")
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
    got = inbox.gather(FedMsg.SA_KEYS, [1, 2], inbox.clock() + FAR, what="keys")
    leaving.join()
    assert got == {1: {"c": 1}}


def test_a_message_for_another_task_or_twice_is_not_taken() -> None:
    inbox = SecureInbox()
    inbox.open({1: 7})
    assert not inbox.offer(1, FedMsg.SA_KEYS, {"c": 0}, task=6)  # an old round's task
    assert inbox.offer(1, FedMsg.SA_KEYS, {"c": 1}, task=7)
    assert not inbox.offer(1, FedMsg.SA_KEYS, {"c": 2}, task=7)  # once per step
    assert inbox.gather(FedMsg.SA_KEYS, [1], inbox.clock() + FAR, what="keys") == {1: {"c": 1}}
