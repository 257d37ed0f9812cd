"""A sync round's wait for answers (`rounds.gather`): each answer to a task it awaits is taken
once, whoever the news names; a stale answer or a departure is told apart; nothing is polled."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from fed_learn.admission import JOINED, ClientHandle, Reply, Task
from fed_learn.rounds import gather
from tests.clocks import HANG_GUARD_S


def handle(client_id: int) -> ClientHandle:
    conn: Any = None  # gather never touches a connection
    return ClientHandle(
        client_id=client_id, name=f"c{client_id}", num_examples=1, conn=conn, joined_round=0
    )


def test_gather_takes_every_answer_once_and_tells_departures_and_stale_answers_apart() -> None:
    news: queue.SimpleQueue[int] = queue.SimpleQueue()
    clients = [handle(i) for i in range(4)]
    tasks = [Task(number=100 + i, round=0) for i in range(4)]
    waiting = {c.client_id: (c, t) for c, t in zip(clients, tasks, strict=True)}
    news.put(JOINED)  # news from before the wait: dropped, every queue is looked at first
    clients[0].results.put_nowait(Reply(tasks[0], None, {}))  # answered before the wait
    taken: list[tuple[int, Reply | None]] = []
    looked = threading.Event()

    def top_up() -> None:  # called once per look: the first one is done, the rest may come
        looked.set()

    def answer_the_rest() -> None:
        looked.wait(HANG_GUARD_S)
        stale = Reply(Task(number=7, round=0), None, {})  # a task withdrawn earlier
        clients[1].results.put_nowait(stale)
        clients[1].results.put_nowait(Reply(tasks[1], None, {}))
        news.put(1)
        clients[2].results.put_nowait(None)  # its session ended
        news.put(2)
        news.put(JOINED)  # a join wakes the wait; nobody's answer is taken for it
        clients[3].results.put_nowait(Reply(tasks[3], None, {}))
        news.put(3)

    helper = threading.Thread(target=answer_the_rest)
    helper.start()
    gather(
        waiting,
        time.monotonic() + HANG_GUARD_S,
        take=lambda client, task, reply: taken.append((client.client_id, reply)),
        what="answers (test)",
        news=news,
        top_up=top_up,
    )
    helper.join(HANG_GUARD_S)
    assert not waiting
    assert sorted(i for i, _ in taken) == [0, 1, 2, 3]  # each once
    replies = dict(taken)
    assert replies[2] is None  # gone: and its marker stays for whoever waits next
    assert clients[2].results.get_nowait() is None
    for i in (0, 1, 3):
        reply = replies[i]
        assert reply is not None and reply.task is tasks[i]
    assert clients[1].results.empty()  # the stale answer went with it


def test_gather_leaves_unanswered_tasks_waiting_at_its_deadline() -> None:
    news: queue.SimpleQueue[int] = queue.SimpleQueue()
    client, task = handle(0), Task(number=1, round=0)
    waiting = {0: (client, task)}
    gather(waiting, 0.0, take=lambda *_: None, what="answers (test)", news=news)  # long past
    assert waiting == {0: (client, task)}
