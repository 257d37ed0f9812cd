"""Secret holders JOINing and leaving a federation from rotating 127.0.x.y addresses, beside
honest clients that train (issue 48, item 3): the per-address JOIN rate never sees the same
address twice; what must hold is that every counted round aggregates the honest clients. The
test (tests/fed_learn/test_join_loops.py) and bench/abuse_bench.py run it from here."""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fed_learn.client import LoRAClient
from fed_learn.config import FedConfig, FedLearnRunConfig
from fed_learn.coordinator import CHECKPOINTS, Coordinator
from fed_learn.lora import block_size, client_data, peft_model
from fed_learn.protocol import FedMsg
from lab.cluster import connect, serve
from lab.config import ClusterConfig, Endpoint, ModelConfig, PathsConfig, TrackingConfig
from lab.models import load_tokenizer
from lab.tracking import METRICS_FILE, Tracker, read_records
from netproto import Connection, NetprotoError, NetTimeout, RemoteError

MODEL = ModelConfig(pretrained="lab:tiny_target", lab_preset="debug")
SECRET = "join-loop-secret"
NUM_LOOPS = 2


@dataclass
class RotatingLoop:
    """A secret holder JOINing from a fresh 127.0.x.y each time (bound before connecting), its
    session held until the coordinator sends it a task (or briefly), then left: a sampled
    session that leaves before any update, at every round it can reach."""

    address: tuple[str, int]
    first: int
    secret: bytes = SECRET.encode()
    welcomed: int = 0
    refused: int = 0
    tasks_left: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        number = self.first
        while not self.stop.is_set():
            number += 1
            host = f"127.0.{number // 250 % 250 + 1}.{number % 250 + 2}"
            try:
                with Connection.connect(
                    *self.address,
                    secret=self.secret,
                    connect_timeout_s=10,
                    source_address=(host, 0),
                ) as conn:
                    conn.request(
                        FedMsg.JOIN,
                        {"name": "rotator", "num_examples": 32, "client_index": number % 2},
                        expect=FedMsg.WELCOME,
                    )
                    self.welcomed += 1
                    with contextlib.suppress(NetTimeout):
                        conn.recv(expect={FedMsg.TASK, FedMsg.FINISH}, timeout_s=0.05)
                        self.tasks_left += 1
            except RemoteError as exc:
                if exc.code != "rate_limited":
                    self.errors.append(str(exc))
                self.refused += 1
            except NetprotoError as exc:
                self.errors.append(str(exc))
            self.stop.wait(0.002)


def settings(run_dir: Path, cache_dir: Path, **fed: Any) -> FedLearnRunConfig:
    """3 rounds of 2 clients on the debug model, short timeouts; `fed`: fields to override."""
    base = FedConfig(
        rounds=3,
        num_clients=2,
        min_fit_clients=2,
        round_timeout_s=60,
        wait_clients_s=30,
        local_steps=2,
        max_examples_per_client=32,
        eval_blocks=4,
        heartbeat_s=0.5,
        heartbeat_timeout_s=20,
    )
    return FedLearnRunConfig(
        model=MODEL,
        fed=replace(base, **fed),
        cluster=ClusterConfig(secret=SECRET),
        paths=PathsConfig(run_dir=str(run_dir), cache_dir=str(cache_dir)),
        tracking=TrackingConfig(wandb=False, console=False),
    )


def _wait_for(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass
class JoinLoopRun:
    """What the rounds did with the loops beside them."""

    budget: int
    rounds: int
    clients: list[int]
    """Per counted round: how many clients it aggregated."""
    rosters: list[list[str]]
    """Per counted round: its checkpoint's roster, by name, and only where it aggregated."""
    welcomed: int
    refused: int
    tasks_left: int
    errors: list[str]
    hung_threads: int
    after_run: bool
    """The loops reached, after the run, what the budget says (refused >= 5 with a budget of
    4; past what 4 would allow otherwise)."""

    @property
    def limit(self) -> int:
        """The most a budget of 4 lets in: 4 JOINs without an update between counted rounds."""
        return 4 * (self.rounds + 1)


def rotating_join_run(
    cache_dir: Path, *, run_dir: Path | None = None, budget: int = 4
) -> JoinLoopRun:
    """Two honest clients that train and two rotating loops, against a live coordinator in
    this process, with fed.idle_join_budget=`budget` (10**6: the control, a budget no loop
    reaches)."""
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="join-loop-"))
    # 2 clients of 4 sampled a round (the honest two and the loops' latest)
    config = settings(run_dir, cache_dir, fraction_fit=0.5, idle_join_budget=budget)
    model = peft_model(MODEL, config.lora, cache_dir=cache_dir)
    coordinator = Coordinator(config, model, torch.randint(0, 300, (4, 32)))
    server = serve(coordinator.handle, config.cluster, Endpoint(), name="coordinator")
    tokenizer = load_tokenizer(MODEL, cache_dir=cache_dir)
    threads: list[threading.Thread] = []
    loops: list[RotatingLoop] = []

    def start(target: object) -> None:
        threads.append(threading.Thread(target=target, daemon=True))  # type: ignore[arg-type]
        threads[-1].start()

    try:
        for index in range(2):
            client_model = peft_model(MODEL, config.lora, cache_dir=cache_dir)
            train, val = client_data(
                tokenizer,
                index=index,
                num_clients=2,
                seed=0,
                block=block_size(client_model),
                max_examples=32,
            )
            client = LoRAClient(client_model, train, val, name=f"honest{index}", index=index)
            conn = connect(config.cluster, server.address)

            def take_part(client: LoRAClient = client, conn: Connection = conn) -> None:
                with conn:
                    client.run(conn, heartbeat_s=config.fed.heartbeat_s)

            start(take_part)
        coordinator.wait_for_clients(2)
        loops = [RotatingLoop(server.address, first) for first in (0, 30_000)[:NUM_LOOPS]]
        for loop in loops:
            start(loop.run)
        with Tracker(run_dir, config={}, tracking=config.tracking, job="attack") as tracker:
            coordinator.run_rounds(tracker)
        # the loops go on after the run: a budget is spent for good once no round counts
        limit = 4 * (config.fed.rounds + 1)
        if budget == 4:
            after = _wait_for(lambda: sum(loop.refused for loop in loops) >= 5, 60)
        else:
            after = _wait_for(lambda: sum(loop.welcomed for loop in loops) > limit, 60)
    finally:  # the loops stop before the server, so none meets a server going away
        for loop in loops:
            loop.stop.set()
        for thread in threads[2:]:
            thread.join(timeout=30)
        server.stop()
        for thread in threads[:2]:
            thread.join(timeout=30)
    records = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
    rosters = []
    for number in range(1, len(records) + 1):
        state = json.loads(
            (run_dir / CHECKPOINTS / f"round_{number:04d}" / "fed_state.json").read_text()
        )
        names = sorted(entry["name"] for entry in state["roster"])
        rosters.append(names if state["outcome"] == "aggregated" else [])
    return JoinLoopRun(
        budget=budget,
        rounds=config.fed.rounds,
        clients=[int(r["clients"]) for r in records],
        rosters=rosters,
        welcomed=sum(loop.welcomed for loop in loops),
        refused=sum(loop.refused for loop in loops),
        tasks_left=sum(loop.tasks_left for loop in loops),
        errors=[e for loop in loops for e in loop.errors],
        hung_threads=sum(thread.is_alive() for thread in threads),
        after_run=after,
    )
