"""What a synchronous or asynchronous run's rounds share: the wait for clients' answers,
their progress bar and the averages a run reports over its rounds."""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from fed_learn.admission import ClientHandle, Reply, Task

log = logging.getLogger(__name__)

ATTEMPTS_PER_ROUND = 3
"""A round that got no update does not count; a run gives up after this many attempts per
round of fed.rounds."""
FIRST_ROUND_GRACE_S = 30.0
"""Before round 1, how long to wait for all fed.num_clients (then min_fit_clients will do)."""
WAKE_S = 0.5
"""The longest an async run's wait, or a secure round's, sleeps without news: it looks at its
deadline then."""
REPORT_FIRST_S, REPORT_EVERY_S = 5.0, 30.0
"""A wait for answers says who it still waits for after 5 s, then every 30 s."""


def drain(news: queue.SimpleQueue[int]) -> set[int]:
    """What `news` holds now, emptied."""
    items = set()
    while True:
        try:
            items.add(news.get_nowait())
        except queue.Empty:
            return items


def gather(
    waiting: dict[int, tuple[ClientHandle, Task]],
    deadline: float,
    *,
    take: Callable[[ClientHandle, Task, Reply | None], None],
    what: str,
    news: queue.SimpleQueue[int],
    top_up: Callable[[], None] | None = None,
) -> None:
    """Hand each answer to a task in `waiting` (client id -> client, its task) to `take`
    (client, task, answer; None: the client is gone) until none is awaited or `deadline`
    passes; `top_up` may add tasks meanwhile. It blocks on `news` (`Admission.news`: the
    sessions put a client's id there with each answer and departure, `JOINED` with each join)
    and looks only at the queues it names, never polling every client's: every queue once
    at the start (answers that came before), then one per answer. Says who it still waits
    for after 5 s, then every 30 s (`what`: for what, under which config key). Tasks
    unanswered at the deadline stay in `waiting`."""
    drain(news)  # before the first look at every queue: what comes after is named
    look: set[int] = set(waiting)
    next_report = time.monotonic() + REPORT_FIRST_S
    while (now := time.monotonic()) < deadline:
        for client_id in look & waiting.keys():
            client, task = waiting[client_id]
            while True:  # answers to a task withdrawn earlier go: not wanted
                try:
                    reply = client.results.get_nowait()
                except queue.Empty:
                    break
                if reply is None:  # gone for good: the marker stays for whoever waits next
                    client.results.put_nowait(None)
                elif reply.task is not task:
                    continue
                del waiting[client_id]
                take(client, task, reply)
                break
        if top_up is not None:
            top_up()
        if not waiting:
            return
        if now >= next_report:
            log.info(
                "waiting for %d clients' %s (ids %s), %.0fs left",
                len(waiting),
                what,
                sorted(waiting)[:16],
                deadline - now,
            )
            next_report += REPORT_EVERY_S
        try:  # until news, the next report or the deadline
            first = news.get(timeout=max(0.0, min(deadline, next_report) - time.monotonic()))
        except queue.Empty:
            look = set()
            continue
        look = {first} | drain(news)


def progress_bar() -> Progress:
    """A transient progress bar (the lab's one progress library, rich): shown on a terminal
    while the work lasts, never left in logs."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), transient=True
    )


def round_averages(history: list[dict[str, float]]) -> dict[str, float]:
    """What a run's rounds averaged: clients, bytes up, the coordinator's CPU share of the
    time (weighted by each round's length, so short rounds do not dominate) and its CPU
    milliseconds a round (over the rounds that measured them: older checkpoints did not), and
    of those the round's own thread's and, of that, evaluation's."""
    if not history:
        return {
            "mean_clients_per_round": 0.0,
            "bytes_up_per_round": 0.0,
            "bytes_up_per_client_round": 0.0,
            "coordinator_share": 0.0,
            "mean_round_s": 0.0,
            "coordinator_cpu_ms_per_round": 0.0,
        }

    def mean_of(key: str) -> dict[str, float]:
        values = [h[key] for h in history if key in h]
        return {f"{key}_per_round": sum(values) / len(values)} if values else {}

    clients = sum(h["clients"] for h in history)
    bytes_up = sum(h["bytes_up"] for h in history)
    seconds = sum(h["round_s"] for h in history)
    return {
        "mean_clients_per_round": clients / len(history),
        "bytes_up_per_round": bytes_up / len(history),
        "bytes_up_per_client_round": bytes_up / clients if clients else 0.0,
        "coordinator_share": (
            sum(h["coordinator_share"] * h["round_s"] for h in history) / seconds
            if seconds
            else 0.0
        ),
        "mean_round_s": seconds / len(history),
        "coordinator_cpu_ms_per_round": 0.0,  # if no round measured it
        **mean_of("coordinator_cpu_ms"),
        **mean_of("coordinator_thread_cpu_ms"),
        **mean_of("eval_cpu_ms"),
    }


def logged_steps(metrics_file: Path) -> set[int]:
    """The steps a metrics file has a row for (none if there is no file); a line a crash cut
    short is skipped, not fatal: it is the row that went missing."""
    steps: set[int] = set()
    lines = metrics_file.read_text().splitlines() if metrics_file.is_file() else []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") == "metrics" and type(row.get("step")) is int:
            steps.add(row["step"])
    return steps


def unlogged_rounds(
    history: list[dict[str, float]], last_round: int, logged: Iterable[int]
) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of the checkpointed rounds missing from `logged`: `history` is a
    checkpoint's, its last entry round `last_round` (1-based, the step it is logged at). A
    coordinator killed between round k's checkpoint and its log line leaves round k only in the
    checkpoint; the resumed run logs it from there, once."""
    have = set(logged)
    first = last_round - len(history) + 1
    return [(first + i, metrics) for i, metrics in enumerate(history) if first + i not in have]
