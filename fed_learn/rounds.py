"""What a synchronous or asynchronous run's rounds share: their progress bar and the
averages a run reports over its rounds."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

ATTEMPTS_PER_ROUND = 3
"""A round that got no update does not count; a run gives up after this many attempts per
round of fed.rounds."""
FIRST_ROUND_GRACE_S = 30.0
"""Before round 1, how long to wait for all fed.num_clients (then min_fit_clients will do)."""


def progress_bar() -> Progress:
    """A transient progress bar (the lab's one progress library, rich): shown on a terminal
    while the work lasts, never left in logs."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), transient=True
    )


def round_averages(history: list[dict[str, float]]) -> dict[str, float]:
    """What a run's rounds averaged: clients, bytes up, and the coordinator's share of the
    time (weighted by each round's length, so short rounds do not dominate)."""
    if not history:
        return {
            "mean_clients_per_round": 0.0,
            "bytes_up_per_round": 0.0,
            "bytes_up_per_client_round": 0.0,
            "coordinator_share": 0.0,
            "mean_round_s": 0.0,
        }
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
    }
