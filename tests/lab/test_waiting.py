"""Waits that speak (lab.waiting): what, where and how long, within seconds and every 30 s after.
Time is injected: nothing here sleeps to make time pass."""

from __future__ import annotations

import fcntl
import logging
import threading
from pathlib import Path

import pytest

from lab.cluster import connect_when_ready
from lab.config import ClusterConfig
from lab.launch import free_port
from lab.pretrain import BuildProgress, _file_lock
from lab.waiting import EVERY_S, FIRST_S, Wait
from netproto.errors import ConnectionClosed, NetTimeout
from tests.clocks import HANG_GUARD_S


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_wait_says_what_where_and_its_limit_first_within_5_s_then_every_30_s() -> None:
    clock, said = Clock(), list[str]()
    wait = Wait("the coordinator", where="127.0.0.1:29510", key="fed.wait_clients_s=120",
                limit_s=130, clock=clock, say=said.append)  # fmt: skip
    assert FIRST_S <= 5 and EVERY_S == 30
    for _ in range(int(95 / 0.5)):  # 95 s of a poll loop's turns, every half second
        wait.tick()
        clock.sleep(0.5)
    # at FIRST_S, then every 30 s: 3, 33, 63, 93
    assert len(said) == 1 + int((95 - FIRST_S) // EVERY_S)
    assert said[0] == (
        "waiting for the coordinator at 127.0.0.1:29510 (fed.wait_clients_s=120): "
        "3 s so far of 2 min 10 s"
    )
    assert said[1].endswith("33 s so far of 2 min 10 s")


def test_a_short_wait_says_nothing() -> None:
    clock, said = Clock(), list[str]()
    wait = Wait("the verifier", clock=clock, say=said.append)
    clock.sleep(FIRST_S - 0.1)
    assert not wait.tick() and not said


def test_a_wait_on_work_shows_how_the_work_goes() -> None:
    clock, said = Clock(), list[str]()
    wait = Wait("a build", clock=clock, say=said.append, progress=lambda: "step 3 of 9")
    clock.sleep(FIRST_S)
    wait.tick()
    assert said == ["waiting for a build: 3 s so far; step 3 of 9"]


def test_dialing_a_closed_port_says_whom_where_and_how_long(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    port = free_port("127.0.0.1")  # nobody listens on it
    caplog.set_level(logging.INFO, logger="lab.waiting")
    with pytest.raises((ConnectionClosed, NetTimeout)):
        connect_when_ready(ClusterConfig(), ("127.0.0.1", port), wait_s=65, what="the coordinator",
                           key="cluster.connect_timeout_s=5 + fed.wait_clients_s=60",
                           clock=clock, sleep=clock.sleep)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.name == "lab.waiting"]
    assert len(lines) == 1 + int((65 - FIRST_S) // EVERY_S)  # 3 s, 33 s, 63 s
    assert lines[0].startswith(
        f"waiting for the coordinator at 127.0.0.1:{port} "
        "(cluster.connect_timeout_s=5 + fed.wait_clients_s=60): 3 s so far of 65 s"
    )


def test_a_build_in_progress_is_shown_to_the_process_waiting_on_it(tmp_path: Path) -> None:
    wall = Clock()
    progress = BuildProgress(tmp_path / ".default-x.progress", clock=wall)
    assert progress.read() == ""
    started = wall.now
    wall.sleep(60)
    progress.update("tiny_target", 300, 900, started=started, then="tiny_draft (1200 steps)")
    text = progress.read()
    assert "is at tiny_target step 300 of 900, about 2 min 00 s left of it" in text
    assert text.endswith("then tiny_draft (1200 steps)")
    wall.sleep(200)  # the builder fell silent: the waiting process says so
    assert "its last word 3 min 20 s ago" in progress.read()
    progress.clear()
    assert progress.read() == ""


def test_waiting_for_a_lock_another_holds_speaks_with_the_holders_progress(
    tmp_path: Path,
) -> None:
    """The builder holds the lock; a second process asks: its wait names the build and shows
    how far the builder is, then it goes on once the lock is free."""
    lock = tmp_path / ".default-x.lock"
    progress = BuildProgress(tmp_path / ".default-x.progress")
    progress.update("tiny_draft", 10, 40, started=0.0)
    said: list[str] = []
    spoke = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        spoke.set()

    wait = Wait("another process's build", where=str(tmp_path), progress=progress.read,
                say=say, first_s=0.0)  # fmt: skip
    got_it = threading.Event()

    def waiter() -> None:
        with _file_lock(lock, waiting=wait):
            got_it.set()

    with open(lock, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        thread = threading.Thread(target=waiter)
        thread.start()
        assert spoke.wait(timeout=HANG_GUARD_S), "the wait said nothing"
        assert not got_it.is_set()
        fcntl.flock(holder, fcntl.LOCK_UN)
    thread.join(timeout=HANG_GUARD_S)
    assert got_it.is_set()
    assert said[0].startswith(f"waiting for another process's build at {tmp_path}")
    assert "is at tiny_draft step 10 of 40" in said[0]
