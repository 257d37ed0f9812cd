"""A client that joins and leaves in a loop, secret in hand: the coordinator forgets each one
that left (its table and checkpoints stay the size of the honest roster), refuses JOINs past
an address's rate, and its rounds go on with the honest clients; a checkpoint taken while
clients come and go reads the table under its lock."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fed_learn.admission import MAX_PROMISED_REFILLS, JoinLimiter
from fed_learn.client import LoRAClient
from fed_learn.config import FedLearnRunConfig
from fed_learn.coordinator import CHECKPOINTS, Coordinator
from fed_learn.lora import block_size, client_data, peft_model
from fed_learn.protocol import FedMsg
from fed_learn.run import rejoin_pause
from lab.cluster import connect, serve
from lab.config import ClusterConfig, Endpoint
from lab.models import load_tokenizer
from lab.tracking import METRICS_FILE, Tracker, read_records
from labtools.attacks.join_loop import MODEL, SECRET, rotating_join_run, settings
from netproto import Connection, NetprotoError, RemoteError, Server
from tests.clocks import HANG_GUARD_S

LOOP_HOSTS = ("127.0.0.2", "127.0.0.3")
"""Each loop dials from an address of its own (another host, as the coordinator sees it)."""


def wait_for(condition: Callable[[], bool], timeout_s: float = HANG_GUARD_S) -> bool:
    """Sessions end (and counters move) just after the client side sees the result."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def stop_all(workers: list[JoinLoop | TableWatch], started: list[threading.Thread]) -> None:
    for worker in workers:
        worker.stop.set()
    for thread in started:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in started), "a loop hung"


def settings_for(tmp_path: Path, lab_cache: Path, **fed: Any) -> FedLearnRunConfig:
    return settings(tmp_path, lab_cache, **fed)


@dataclass
class JoinLoop:
    """JOIN, then leave at once, again and again, from `host`, with the secret."""

    host: str
    address: tuple[str, int]
    secret: bytes | None = SECRET.encode()
    welcomed: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def join_once(self) -> None:
        with Connection.connect(
            *self.address,
            secret=self.secret,
            connect_timeout_s=HANG_GUARD_S,  # a handshake on a busy box is slow, not refused
            source_address=(self.host, 0),
        ) as conn:
            try:
                conn.request(
                    FedMsg.JOIN, {"name": "looper", "num_examples": 32}, expect=FedMsg.WELCOME
                )
                self.welcomed += 1
            except RemoteError as exc:
                if exc.code != "rate_limited":
                    raise
                self.refused += 1

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.join_once()
            except NetprotoError as exc:  # not expected: the test says which
                self.errors.append(str(exc))
            self.stop.wait(0.002)


@dataclass
class TableWatch:
    """The largest the coordinator's client table got while it watched."""

    coordinator: Coordinator
    largest: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.005):
            self.largest = max(self.largest, len(self.coordinator.clients))


@pytest.fixture
def threads() -> Iterator[Callable[[Callable[[], None]], threading.Thread]]:
    """Start a daemon thread; each is waited for at the end, and must have ended."""
    started: list[threading.Thread] = []

    def start(target: Callable[[], None]) -> threading.Thread:
        started.append(threading.Thread(target=target, daemon=True))
        started[-1].start()
        return started[-1]

    yield start
    for thread in started:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in started), "a thread hung"


@pytest.fixture
def coordinator_server(
    tiny_models: Path, lab_cache: Path
) -> Iterator[Callable[[FedLearnRunConfig], tuple[Coordinator, Server]]]:
    servers: list[Server] = []

    def start(settings: FedLearnRunConfig) -> tuple[Coordinator, Server]:
        model = peft_model(MODEL, settings.lora, cache_dir=lab_cache)
        coordinator = Coordinator(settings, model, torch.randint(0, 300, (4, 32)))
        servers.append(serve(coordinator.handle, settings.cluster, Endpoint(), name="coordinator"))
        return coordinator, servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_two_join_and_leave_loops_leave_every_round_to_the_honest_clients(
    coordinator_server, threads, tmp_path: Path, lab_cache: Path
) -> None:
    settings = settings_for(tmp_path, lab_cache, join_burst_per_address=8)
    coordinator, server = coordinator_server(settings)
    tokenizer = load_tokenizer(MODEL, cache_dir=lab_cache)
    for index in range(2):  # two real clients, training
        model = peft_model(MODEL, settings.lora, cache_dir=lab_cache)
        train, val = client_data(
            tokenizer, index=index, num_clients=2, seed=0, block=block_size(model), max_examples=32
        )
        client = LoRAClient(model, train, val, name=f"honest{index}")
        conn = connect(settings.cluster, server.address)

        def take_part(client: LoRAClient = client, conn: Connection = conn) -> None:
            with conn:
                client.run(conn, heartbeat_s=settings.fed.heartbeat_s)

        threads(take_part)
    coordinator.wait_for_clients(2)
    loops = [JoinLoop(host, server.address) for host in LOOP_HOSTS]
    watch = TableWatch(coordinator)
    workers: list[JoinLoop | TableWatch] = [*loops, watch]
    started = [threads(worker.run) for worker in workers]
    try:
        with Tracker(tmp_path, config={}, tracking=settings.tracking, job="test") as tracker:
            coordinator.run_rounds(tracker)
        # every loop past its burst: refused at its address's rate from then on
        past_bursts = wait_for(lambda: all(loop.refused >= 5 for loop in loops))
    finally:
        stop_all(workers, started)
    assert not any(loop.errors for loop in loops), [loop.errors for loop in loops]
    rounds = [r for r in read_records(tmp_path / METRICS_FILE) if "clients" in r]
    assert [r["clients"] for r in rounds] == [2, 2, 2]  # the honest two, every round
    for number in (1, 2, 3):
        state = json.loads(
            (tmp_path / CHECKPOINTS / f"round_{number:04d}" / "fed_state.json").read_text()
        )
        assert state["outcome"] == "aggregated"
        assert sorted(entry["name"] for entry in state["roster"]) == ["honest0", "honest1"]
    # at most the honest two plus each loop's last client and the one it just left
    assert watch.largest <= 2 + 2 * len(loops)
    assert wait_for(lambda: not coordinator.clients)  # after FINISH, all left: none kept
    assert past_bursts
    admission = coordinator.admission  # refused by an address's rate or its range's budget
    # each spent its burst at least, unless its range's JOIN budget (shared with the honest
    # two: all of 127/8 is one range) refused it first: which of the two comes first depends
    # on how fast the rounds go, so their sum is what holds on any machine
    assert sum(loop.welcomed for loop in loops) + admission.budget_refused >= 2 * 8
    assert admission.joins_refused + admission.budget_refused == sum(j.refused for j in loops)


def test_joins_past_an_addresss_burst_are_refused_and_others_still_join(
    coordinator_server, tmp_path: Path, lab_cache: Path
) -> None:
    settings = settings_for(
        tmp_path, lab_cache, join_burst_per_address=3, join_rate_per_address=0.001
    )
    coordinator, server = coordinator_server(settings)
    loop = JoinLoop(LOOP_HOSTS[0], server.address)
    for _ in range(10):
        loop.join_once()
    assert (loop.welcomed, loop.refused) == (3, 7)  # a token per 1,000 s: none came back
    assert coordinator.admission.joins_refused == 7
    assert wait_for(lambda: not coordinator.clients)  # the three that joined have left
    with connect(settings.cluster, server.address) as conn:  # from 127.0.0.1: its own bucket
        welcome = conn.request(
            FedMsg.JOIN, {"name": "honest", "num_examples": 10}, expect=FedMsg.WELCOME
        ).payload
        assert welcome == {"client_id": 3}  # ids are never given twice
        assert [c.name for c in coordinator.alive_clients()] == ["honest"]


def test_a_checkpoint_taken_while_clients_join_and_leave_does_not_raise(
    coordinator_server, threads, tmp_path: Path, lab_cache: Path
) -> None:
    """Thread switches forced every 10 microseconds: a read of the client table without the
    lock meets a JOIN changing it ("dictionary changed size during iteration")."""
    settings = settings_for(
        tmp_path,
        lab_cache,
        join_burst_per_address=10**6,
        join_rate_per_address=10**6,
        idle_join_budget=10**6,
    )
    settings = replace(settings, cluster=ClusterConfig())  # no handshake: JOINs come faster
    coordinator, server = coordinator_server(settings)
    loops = [JoinLoop("127.0.0.1", server.address, secret=None) for _ in range(2)]
    started = [threads(loop.run) for loop in loops]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        assert wait_for(lambda: sum(loop.welcomed for loop in loops) >= 50)
        for _ in range(30):
            coordinator.checkpoint({"val_loss": 1.0}, outcome="test")
    finally:
        sys.setswitchinterval(interval)
        stop_all(list(loops), started)
    assert not any(loop.errors for loop in loops), [loop.errors for loop in loops]
    state = json.loads((tmp_path / CHECKPOINTS / "round_0001" / "fed_state.json").read_text())
    assert state["roster"] == []  # nobody took part in a round


def test_a_join_bucket_refills_at_its_rate_and_forgets_the_least_recent_address() -> None:
    limiter = JoinLimiter(rate=2.0, burst=3)
    assert [limiter.allow("a", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("a", now=0.4) is False  # 0.8 of a token
    assert limiter.allow("a", now=0.5) is True  # one whole token at 2 a second
    assert limiter.allow("b", now=0.5) is True  # another address: its own bucket
    assert [limiter.allow("a", now=100.0) for _ in range(4)] == [True, True, True, False]


def test_refused_joins_are_promised_one_later_token_each_in_their_order() -> None:
    limiter = JoinLimiter(rate=2.0, burst=2)
    assert [limiter.allow("a", now=0.0) for _ in range(3)] == [True, True, False]
    waits = [limiter.retry_after("a", now=0.0)]  # the third JOIN's refusal
    for _ in range(2):  # two more refused at once: each told a later token, not the same one
        assert limiter.allow("a", now=0.0) is False
        waits.append(limiter.retry_after("a", now=0.0))
    assert waits == pytest.approx([0.5, 1.0, 1.5])
    for wait in waits:  # each coming back when told finds its token
        assert limiter.allow("a", now=wait) is True
    assert limiter.allow("b", now=0.0) is True  # another address: its own bucket and promises
    assert limiter.retry_after("c", now=0.0) == 0.0  # nothing spent: no wait


def test_a_flood_of_refused_joins_cannot_tell_an_honest_client_to_stay_away_for_long() -> None:
    """A stranger sharing the address range (or any local process: 127/8 is one range) that
    sends a thousand JOINs at once is refused each; the next honest client is told to come
    back within MAX_PROMISED_REFILLS refills, not after a thousand promises."""
    limiter = JoinLimiter(rate=1.0, burst=2)
    for _ in range(1000):
        limiter.allow("a", now=0.0)
        limiter.retry_after("a", now=0.0)
    assert limiter.allow("a", now=0.0) is False
    assert limiter.retry_after("a", now=0.0) <= MAX_PROMISED_REFILLS / 1.0


def test_a_client_refused_for_the_join_rate_waits_what_it_was_told_else_a_refill() -> None:
    for draw in (0.0, 0.5, 1.0):
        told = rejoin_pause(3.0, 1.0, draw=draw)
        assert 3.0 <= told <= 3.0 * 1.05 + 0.02  # never early: its token comes then
        assert 1.0 <= rejoin_pause(None, 1.0, draw=draw) <= 2.0  # not said: one or two refills
        # whoever answers the JOIN: no spinning on redials, no parking for an hour
        assert 0.5 <= rejoin_pause(0.0, 1.0, draw=draw) < 1.0
        assert rejoin_pause(3600.0, 1.0, draw=draw) <= MAX_PROMISED_REFILLS * 1.05
        assert rejoin_pause(3600.0, 4.0, draw=draw) <= MAX_PROMISED_REFILLS * 1.05 / 4
    assert rejoin_pause(0.0, 4.0, draw=1.0) == pytest.approx(0.5 / 4)  # half a refill at least


def test_a_join_refused_for_the_rate_says_when_its_token_comes(
    tmp_path: Path, lab_cache: Path
) -> None:
    from fed_learn.admission import Admission

    fed = replace(settings_for(tmp_path, lab_cache).fed, join_rate_per_address=0.5)
    admission = Admission(fed)
    admission._joins = JoinLimiter(rate=0.5, burst=1, clock=lambda: 0.0)  # a still clock
    answers: list[float | None] = []

    def handler(conn: Connection) -> None:
        admission.admit(conn, at_round=lambda: 0)

    with Server(handler) as server:
        for _ in range(3):
            with Connection.connect(*server.address) as conn:
                try:
                    conn.request(
                        FedMsg.JOIN, {"name": "c", "num_examples": 8}, expect=FedMsg.WELCOME
                    )
                    answers.append(None)
                except RemoteError as exc:
                    assert exc.code == "rate_limited"
                    answers.append(exc.retry_after_s)
    assert answers == [None, 2.0, 4.0]  # the burst's one token, then one every 2 s, in order


@pytest.mark.parametrize("budget", [4, 10**6], ids=["budget", "control"])
def test_rotating_addresses_joining_and_leaving_leave_every_round_to_the_honest_clients(
    tiny_models: Path, tmp_path: Path, lab_cache: Path, budget: int
) -> None:
    """Two such loops (labtools.attacks.join_loop) beside two honest clients, two sampled a
    round: a round closes on two updates, asking the other clients when a sampled one leaves,
    so every counted round holds the honest two. The per-address limit never sees the same
    address twice; what bounds the loops is the budget of their range, 127/8 (control: a
    budget no loop reaches: past what a budget of 4 allows, never refused)."""
    got = rotating_join_run(lab_cache, run_dir=tmp_path, budget=budget)
    assert got.hung_threads == 0, "a loop or client hung"
    assert not got.errors, got.errors
    assert got.after_run, got
    assert got.clients == [2, 2, 2]
    assert got.rosters == [["honest0", "honest1"]] * 3  # each round aggregated, the honest two
    print(
        f"budget {budget}: {got.welcomed} let in, {got.refused} refused, "
        f"{got.tasks_left} left holding a task"
    )
    if budget == 4:
        assert got.refused >= 5 and got.welcomed <= got.limit
    else:  # the per-address limit alone: never the same address twice, never refused
        assert got.refused == 0 and got.welcomed > got.limit
