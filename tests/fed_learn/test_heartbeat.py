"""A client's heartbeat: a PING only after `fed.heartbeat_s` with nothing sent, so the
coordinator hears from every client at least that often (liveness) without a PING (and its
PONG) a beat from a client that is busy answering a round anyway."""

from __future__ import annotations

import socket
import time

from fed_learn.client import LoRAClient
from netproto import Connection, MsgType


class Beats:
    """The heartbeat's stop event, driven by the test: `wait` returns False `ticks` times
    (a beat is due to be considered), then True (stopped), recording how long it was asked
    to wait each time."""

    def __init__(self, ticks: int) -> None:
        self.ticks = ticks
        self.waits: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.ticks -= 1
        return self.ticks < 0


class Sender:
    """A connection as the heartbeat sees it: when it last sent, and what it is asked to send."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self.sent: list[int] = []
        self._never = time.monotonic() - 3600.0

    @property
    def last_sent(self) -> float:  # busy: it has just sent a round's message, every time
        return time.monotonic() if self.busy else self._never

    def send(self, msg_type: int) -> int:
        self.sent.append(msg_type)
        return 0


def test_a_silent_client_pings_every_beat() -> None:
    conn, stop = Sender(busy=False), Beats(ticks=5)
    LoRAClient._heartbeat(conn, 2.0, stop)  # type: ignore[arg-type]
    assert conn.sent == [MsgType.PING] * 5
    assert stop.waits == [2.0] * 6  # a full beat after each PING


def test_a_client_that_keeps_sending_sends_no_ping() -> None:
    conn, stop = Sender(busy=True), Beats(ticks=5)
    LoRAClient._heartbeat(conn, 2.0, stop)  # type: ignore[arg-type]
    assert conn.sent == []
    # each wait runs to a beat after what it last sent: never longer than a beat
    assert all(0.0 < wait <= 2.0 for wait in stop.waits) and len(stop.waits) == 6


def test_a_connection_records_when_it_last_sent_a_frame() -> None:
    ours, theirs = socket.socketpair()
    with Connection(ours, peer="a") as sender, Connection(theirs, peer="b") as peer:
        before = sender.last_sent
        marked = time.monotonic()
        sender.send(MsgType.DATA_JSON, {"x": 1})
        assert sender.last_sent >= marked >= before
        assert peer.recv(expect=MsgType.DATA_JSON).payload == {"x": 1}
        assert peer.last_sent < marked  # it sent nothing
