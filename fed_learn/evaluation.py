"""Federated evaluation (`fed.evaluate_on_clients`): the global adapter measured on each sampled
client's own held-out shard, the only evaluation there is when the coordinator holds no data
(Flower's configure_evaluate / aggregate_evaluate).

Every `fed.eval_every` rounds (and after the last), once the round's adapter is in place, the
coordinator sends an EVALUATE and the global adapter to `fed.fraction_evaluate` of the clients
connected (at least one) and waits up to `fed.round_timeout_s` for their EVAL_RESULTs: loss and
token count. The round's metrics get the token-weighted mean (`client_eval_loss`), the spread
(`client_eval_loss_std`, `_min`, `_max`, over clients) and each client's loss
(`client_eval_loss/<client id>`). An answer whose loss is not a finite number >= 0, or whose
token count is not in 1..what the client declared at JOIN (`eval_tokens`), is refused by name
and left out of the mean (`client_eval_refused`).

With secure aggregation the evaluation travels in clear: each client's loss and token count,
like its weight, are plain JSON the coordinator reads per client (no masking: a loss is one
number about the global model on the client's data, not an update).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from fed_learn.admission import ClientHandle, Reply, Task
from fed_learn.protocol import Evaluation
from fed_learn.rounds import gather

log = logging.getLogger(__name__)

PER_CLIENT = "client_eval_loss/"
"""The prefix of each client's loss in a round's metrics (then its client id)."""


def summarize(evaluations: Sequence[tuple[int, Evaluation]]) -> dict[str, float]:
    """A round's federated evaluation from (client id, checked answer) pairs: the mean loss
    weighted by tokens, the spread over clients, and each client's loss."""
    if not evaluations:
        return {"client_eval_clients": 0.0}
    losses = [e.loss for _, e in evaluations]
    tokens = sum(e.tokens for _, e in evaluations)
    mean = sum(e.loss * e.tokens for _, e in evaluations) / tokens
    unweighted = sum(losses) / len(losses)
    return {
        "client_eval_loss": mean,
        "client_eval_loss_std": math.sqrt(sum((x - unweighted) ** 2 for x in losses) / len(losses)),
        "client_eval_loss_min": min(losses),
        "client_eval_loss_max": max(losses),
        "client_eval_clients": float(len(evaluations)),
        "client_eval_tokens": float(tokens),
        **{f"{PER_CLIENT}{client_id}": e.loss for client_id, e in evaluations},
    }


def client_eval_summary(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """The run's last federated evaluation, for its summary (nothing if none ran)."""
    for index in range(len(history) - 1, -1, -1):
        if "client_eval_loss" in history[index]:
            return {
                "final_client_eval_loss": history[index]["client_eval_loss"],
                "final_client_eval_std": history[index]["client_eval_loss_std"],
                "client_eval_round": float(index + 1),
            }
    return {}


class ClientEvaluator:
    """Runs federated evaluation for a `fed_learn.coordinator.Coordinator` (typed loosely: that
    module imports this one), through its sessions and task bookkeeping."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.fed = coordinator.fed
        self.rng = random.Random(f"{coordinator.settings.seed}-evaluate")
        if self.fed.evaluate_on_clients and self.fed.secure_aggregation:
            log.info(
                "federated evaluation under secure aggregation: each client's evaluation loss "
                "and token count travel in clear (not masked); updates stay masked"
            )

    def due(self, round_index: int, *, last: int) -> bool:
        """Whether round `round_index` (0-based) ends with a federated evaluation."""
        if not self.fed.evaluate_on_clients:
            return False
        return (round_index + 1) % self.fed.eval_every == 0 or round_index == last

    def run(self, global_state: dict[str, torch.Tensor]) -> dict[str, float]:
        """Evaluate `global_state` on sampled clients' held-out shards; the round's metrics."""
        coordinator, fed = self.coordinator, self.fed
        round_index = coordinator.round
        eligible = [
            c
            for c in coordinator.alive_clients()
            if c.eval_tokens > 0 and c.client_id not in coordinator.excluded
        ]
        if not eligible:
            log.warning(
                "round %d: no connected client declared held-out data: no federated evaluation",
                round_index + 1,
            )
            return {"client_eval_clients": 0.0}
        size = max(1, math.ceil(fed.fraction_evaluate * len(eligible)))
        sampled = sorted(self.rng.sample(eligible, size), key=lambda c: c.client_id)
        pending: dict[int, tuple[ClientHandle, Task]] = {}
        failures = 0
        for client in sampled:
            task = coordinator.send_task(client, round_index, global_state, evaluate=True)
            if task is None:
                failures += 1
            else:
                pending[client.client_id] = (client, task)
        taken: list[tuple[int, Evaluation]] = []
        refused = 0

        def take(client: ClientHandle, task: Task, reply: Reply | None) -> None:
            nonlocal failures, refused
            if reply is None:
                failures += 1
            elif reply.evaluation is None:
                refused += 1
                log.warning(
                    "round %d: refused client %d (%s)'s evaluation: %s; left out of the mean",
                    round_index + 1,
                    client.client_id,
                    client.name,
                    reply.error,
                )
            else:
                taken.append((client.client_id, reply.evaluation))

        what = f"evaluations on their own data in round {round_index + 1} (fed.round_timeout_s)"
        deadline = time.monotonic() + fed.round_timeout_s
        gather(pending, deadline, take=take, what=what, news=coordinator.admission.news)
        for client, task in pending.values():  # too late
            coordinator.withdraw(client, task)
            failures += 1
        metrics = summarize(taken)
        metrics["client_eval_refused"] = float(refused)
        metrics["client_eval_failures"] = float(failures)
        if taken:
            log.info(
                "round %d: client-evaluated loss %.4f (token-weighted, %d clients; spread %.4f, "
                "%.4f..%.4f)",
                round_index + 1,
                metrics["client_eval_loss"],
                len(taken),
                metrics["client_eval_loss_std"],
                metrics["client_eval_loss_min"],
                metrics["client_eval_loss_max"],
            )
        return metrics
