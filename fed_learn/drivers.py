"""Round drivers: what the coordinator's loop calls to run its rounds (Flower's server loop
over a `Strategy`; SecAgg+ as a workflow of its own).

A driver is picked by the run's settings (`RoundDriver.create`): `plain` (sync rounds: send
the adapter, gather the answers, aggregate them with the strategy), `secure` (sync rounds
under secure aggregation, `fed_learn.secure`) or `async` (`fed_learn.async_rounds`). The sync
ones share one loop (`SyncRounds`: sampling, attempts, evaluation, metrics, checkpoints) and
differ in `play`, one round's work. The coordinator keeps the sessions, tasks and checkpoints.

A round's clock starts once its clients are sampled (not while waiting for clients to join);
the coordinator's share of it is the CPU seconds its process spent meanwhile (every thread:
sessions reading answers, the round's own work) over the round's wall time (`CpuClock`). Each
round's metrics split it: the round's own thread (`coordinator_thread_cpu_ms`: the protocol,
aggregation, evaluation, checkpoint), of which evaluating the new adapter (`eval_cpu_ms`), and
the rest: the session threads reading what clients send, and torch's intra-op worker threads
where the coordinator runs more than one (their share of evaluation and aggregation lands
there; a local run gives each process its share of the cores, one thread each on 2 cores).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fed_learn.admission import ClientHandle, NotEnoughClientsError, Reply, Task
from fed_learn.evaluation import client_eval_summary
from fed_learn.lora import adapter_state, load_adapter_state
from fed_learn.protocol import ClientResult
from fed_learn.rounds import (
    ATTEMPTS_PER_ROUND,
    FIRST_ROUND_GRACE_S,
    drain,
    gather,
    progress_bar,
    round_averages,
)
from fed_learn.secure import SecureRound
from fed_learn.updates import ANSWER_ERRORS, check_answer
from lab.losses import evaluate
from lab.tracking import Tracker
from netproto.errors import peer_text

log = logging.getLogger(__name__)


class CpuClock:
    """The coordinator process's CPU seconds (user + system, all threads) and wall time
    since `start`: a round's own cost, whatever thread spent it. Read from the kernel's
    process clock (CLOCK_PROCESS_CPUTIME_ID), to the nanosecond: the same figure as
    `psutil.Process().cpu_times()`'s user + system, which /proc gives in 10 ms ticks (a
    round's reading then off by up to a tick, and not comparable to its thread's clock)."""

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def _cpu() -> float:
        return time.process_time()

    def start(self) -> None:
        self.cpu_started, self.wall_started = self._cpu(), time.perf_counter()
        self.thread_started, self._thread = time.thread_time(), threading.get_ident()

    def read(self) -> tuple[float, float]:
        """(CPU seconds, wall seconds) since `start`."""
        return self._cpu() - self.cpu_started, time.perf_counter() - self.wall_started

    def thread_s(self) -> float | None:
        """CPU seconds the thread that started the clock spent since (the round's own work,
        not torch's worker threads'); None when read from another thread."""
        if threading.get_ident() != self._thread:
            return None
        return time.thread_time() - self.thread_started


def timed_evaluate(model: Any, blocks: torch.Tensor) -> tuple[float, float]:
    """`evaluate(model, blocks)` and the CPU milliseconds this thread spent on it (torch's
    other intra-op threads, if it has any, not counted)."""
    started = time.thread_time()
    loss = evaluate(model, blocks)
    return loss, 1000.0 * (time.thread_time() - started)


@dataclass
class Collected:
    """A sync round's answers: the admitted updates with their credited weights and results,
    and the sampled clients that failed (gone, too late, or refused: `refused` of them)."""

    updates: list[tuple[dict[str, torch.Tensor], int]] = field(default_factory=list)
    results: list[ClientResult] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)
    refused: int = 0
    largest_norm: float = 0.0
    """The largest admitted update's norm (see fed.max_update_norm)."""
    secure_clients: int | None = None
    """A secure round: the clients whose inputs its sum holds (it has no `updates`)."""
    secure_inputs: int = 0
    """A secure round: the masked inputs it took (its sum may still have been refused)."""

    @property
    def arrived(self) -> int:
        """Answers that came, taken or refused: a round with none is not counted."""
        taken = len(self.updates) if self.secure_clients is None else self.secure_inputs
        return taken + self.refused

    @property
    def clients(self) -> int:
        """Clients whose updates the round took."""
        return len(self.updates) if self.secure_clients is None else self.secure_clients


class RoundDriver(ABC):
    """Runs a run's rounds for a `fed_learn.coordinator.Coordinator` (typed loosely: that
    module imports this one) and returns the run's headline metrics."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, type[RoundDriver]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            RoundDriver.registry[cls.name] = cls

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.fed = coordinator.fed

    @abstractmethod
    def run(self, tracker: Tracker) -> dict[str, float]:
        """Every round the run has left to run (logged, checkpointed); the run's metrics."""

    @staticmethod
    def name_for(fed: Any) -> str:
        """The driver `fed` (FedConfig) asks for."""
        if fed.mode == "async":
            return "async"
        return "secure" if fed.secure_aggregation else "plain"

    @classmethod
    def create(cls, coordinator: Any) -> RoundDriver:
        return cls.registry[cls.name_for(coordinator.fed)](coordinator)


class SyncRounds(RoundDriver):
    """Synchronous rounds: sample, `play` the round, evaluate, log, checkpoint."""

    most_clients: int | None = None
    """The most clients a round samples (a secure round's: fed.secagg.max_clients)."""

    @abstractmethod
    def play(
        self, sampled: list[ClientHandle], global_state: dict[str, torch.Tensor]
    ) -> tuple[Collected, str]:
        """One round with `sampled` from `global_state`: its answers and its outcome (the
        next global adapter loaded, or said why not)."""

    def run(self, tracker: Tracker) -> dict[str, float]:
        coordinator, fed = self.coordinator, self.fed
        rounds = coordinator.rounds_to_run()
        rng = random.Random(coordinator.settings.seed)
        history = coordinator.history
        initial_loss = coordinator.initial_val_loss(tracker, rounds.start)
        clock = CpuClock()
        attempts, round_index = 0, rounds.start
        while round_index < rounds.stop:
            if attempts >= ATTEMPTS_PER_ROUND * fed.rounds:
                coordinator.finish_clients()
                raise NotEnoughClientsError(
                    f"{attempts} round attempts ({ATTEMPTS_PER_ROUND} x fed.rounds) and only "
                    f"{round_index - rounds.start} of {len(rounds)} rounds had an update: "
                    "the clients sampled left or failed before sending one"
                )
            attempts += 1
            coordinator.round = round_index  # a client joining now starts next round
            first = round_index == rounds.start  # give the whole roster a moment to join
            alive = coordinator.wait_for_clients(
                fed.min_fit_clients,
                hoped=fed.num_clients if first else 0,
                grace_s=min(FIRST_ROUND_GRACE_S, fed.wait_clients_s) if first else 0.0,
            )
            alive = [c for c in alive if c.client_id not in coordinator.excluded]
            size = max(fed.min_fit_clients, math.ceil(fed.fraction_fit * len(alive)))
            size = min(size, len(alive), self.most_clients or len(alive))
            sampled = sorted(rng.sample(alive, size), key=lambda c: c.client_id)
            clock.start()
            drain(coordinator.admission.news)  # bounded: a secure round waits on its inbox
            global_state = adapter_state(coordinator.model)
            traffic_before = coordinator.admission.traffic(sampled)
            collected, outcome = self.play(sampled, global_state)
            if collected.arrived == 0:
                log.warning(
                    "round %d: no update came (%d sampled clients failed or left): attempt %d "
                    "of at most %d, not counted as a round",
                    round_index + 1,
                    len(collected.failures),
                    attempts,
                    ATTEMPTS_PER_ROUND * fed.rounds,
                )
                continue
            coordinator.admission.round_counted()
            round_index += 1
            val_loss, eval_ms = timed_evaluate(coordinator.model, coordinator.val_blocks)
            traffic = coordinator.admission.traffic(sampled)
            results = collected.results
            metrics = {
                "val_loss": val_loss,
                "eval_cpu_ms": eval_ms,
                "clients": float(collected.clients),
                "failures": float(len(collected.failures)),
                "refused": float(collected.refused),
                "largest_update_norm": collected.largest_norm,
                "bytes_down": float(traffic[0] - traffic_before[0]),
                "bytes_up": float(traffic[1] - traffic_before[1]),
                "client_train_loss": (
                    sum(r.train_loss for r in results) / len(results) if results else math.nan
                ),
            }
            if coordinator.accountant is not None:  # the round's privacy, spent: logged
                metrics["dp_epsilon"] = coordinator.accountant.spend(
                    coordinator.noise_multiplier, len(sampled) / len(alive), fed.dp.delta
                )
            if coordinator.evaluator.due(coordinator.round, last=rounds.stop - 1):
                metrics.update(coordinator.evaluator.run(adapter_state(coordinator.model)))
            history.append(coordinator.close_round(metrics, outcome=outcome, clock=clock))
            tracker.log(metrics, step=coordinator.round + 1)
            log.info(
                "round %d/%d: %s from %d clients, val loss %.4f",
                coordinator.round + 1,
                rounds.stop,
                outcome,
                collected.clients,
                val_loss,
            )
        coordinator.finish_clients()
        final = history[-1] if history else {"val_loss": initial_loss}
        return {
            "initial_val_loss": initial_loss,
            "final_val_loss": final["val_loss"],
            "rounds": float(len(history)),  # the whole run's, rounds before a resume included
            "refused": sum(h["refused"] for h in history),
            "dropped_results": float(coordinator.admission.dropped_results()),
            **round_averages(history),
            **coordinator.privacy_summary(),
            **client_eval_summary(history),
        }


class PlainRounds(SyncRounds):
    """A round in the clear: every sampled client trains from the global adapter and sends
    its own; the strategy (DP's wrapper included, `privacy.DPMean`) aggregates them."""

    name = "plain"

    def play(
        self, sampled: list[ClientHandle], global_state: dict[str, torch.Tensor]
    ) -> tuple[Collected, str]:
        coordinator, fed = self.coordinator, self.fed
        coordinator.strategy.configure_round(global_state, [c.num_examples for c in sampled])
        tasks = {
            c.client_id: coordinator.send_task(c, coordinator.round, global_state) for c in sampled
        }
        collected = self.collect(sampled, tasks, global_state)
        if collected.arrived == 0:
            return collected, "no update"
        if len(collected.updates) < fed.min_fit_clients:
            log.warning(
                "round %d: only %d of %d clients returned updates (need %d); "
                "keeping the previous global adapter",
                coordinator.round,
                len(collected.updates),
                len(sampled),
                fed.min_fit_clients,
            )
            return collected, "kept previous adapter"
        return collected, coordinator.apply(collected.updates, global_state)

    def collect(
        self,
        sampled: list[ClientHandle],
        tasks: dict[int, Task | None],
        global_state: dict[str, torch.Tensor],
    ) -> Collected:
        """Wait for the round's answers until its deadline; admit or refuse each. A round
        closes on fed.min_fit_clients updates (or its deadline), never on sessions that left:
        while the updates taken and those awaited are fewer, it asks clients it has not asked
        yet, newcomers included (appended to `sampled`). Tasks still unanswered at the
        deadline are withdrawn (a late answer is dropped)."""
        coordinator, need = self.coordinator, self.fed.min_fit_clients
        collected = Collected()
        waiting = {c.client_id: (c, t) for c in sampled if (t := tasks[c.client_id]) is not None}
        collected.failures += [c.client_id for c in sampled if tasks[c.client_id] is None]
        asked = {c.client_id for c in sampled}
        with progress_bar() as progress:  # transient: gone once the round is
            bar = progress.add_task(f"round {coordinator.round + 1}", total=len(asked))

            def top_up() -> None:  # those asked left or failed: ask others
                for client in coordinator.alive_clients():
                    if len(collected.updates) + len(waiting) >= need:
                        break
                    if client.client_id in asked or client.client_id in coordinator.excluded:
                        continue
                    asked.add(client.client_id)
                    sampled.append(client)  # DP's denominator counts it too
                    weights = [c.num_examples for c in sampled]
                    coordinator.strategy.configure_round(global_state, weights)
                    task = coordinator.send_task(client, coordinator.round, global_state)
                    if task is not None:
                        waiting[client.client_id] = (client, task)
                progress.update(bar, total=len(asked))

            def take(client: ClientHandle, task: Task, reply: Reply | None) -> None:
                coordinator.withdraw(client, task)
                progress.advance(bar)
                if reply is None:
                    collected.failures.append(client.client_id)
                else:
                    self.admit(client, reply, global_state, collected)

            deadline = time.monotonic() + self.fed.round_timeout_s
            what = f"updates in round {coordinator.round + 1} (fed.round_timeout_s)"
            news = coordinator.admission.news
            gather(waiting, deadline, take=take, what=what, news=news, top_up=top_up)
        for client, task in waiting.values():  # too late
            coordinator.withdraw(client, task)
            collected.failures.append(client.client_id)
        return collected

    def admit(
        self,
        client: ClientHandle,
        reply: Reply,
        global_state: dict[str, torch.Tensor],
        collected: Collected,
    ) -> None:
        """Admit `client`'s answer into `collected`, or refuse it (its failure, counted)."""
        coordinator = self.coordinator
        try:
            result, update, norm = check_answer(
                reply, global_state, strategy=coordinator.strategy, fed=self.fed
            )
        except ANSWER_ERRORS as exc:
            log.warning(
                "round %d: refused client %d's answer: %s",
                coordinator.round,
                client.client_id,
                peer_text(exc),
            )
            collected.failures.append(client.client_id)
            collected.refused += 1
            return
        collected.results.append(result)
        collected.updates.append((update, coordinator.credited_weight(client, result)))
        coordinator.took_part(client)
        collected.largest_norm = max(collected.largest_norm, norm)


class SecureRounds(SyncRounds):
    """A round under secure aggregation (fed_learn.secure): the coordinator unmasks the sum
    of the round's updates, never one of them; DP's noise is the clients' to add."""

    name = "secure"

    def __init__(self, coordinator: Any) -> None:
        super().__init__(coordinator)
        self.most_clients = self.fed.secagg.max_clients  # what its clients agree to take part in

    def play(
        self, sampled: list[ClientHandle], global_state: dict[str, torch.Tensor]
    ) -> tuple[Collected, str]:
        coordinator, fed = self.coordinator, self.fed
        trained = {n: global_state[n] for n in sorted(coordinator.strategy.trained(global_state))}
        secure = SecureRound.for_round(
            fed,
            coordinator.secure_inbox,
            sampled,
            trained,
            coordinator.round,
            coordinator.noise_multiplier,
            digests=coordinator.input_digests,
        )
        numbers = {c.client_id: secrets.randbelow(2**53) for c in sampled}
        coordinator.secure_inbox.open(numbers)  # listening before the TASKs go out
        tasks: dict[int, int] = {}
        for client in sampled:
            task = coordinator.send_task(
                client,
                coordinator.round,
                global_state,
                number=numbers[client.client_id],
                extra=secure.task_fields(client.client_id),
            )
            if task is not None:
                tasks[client.client_id] = task.number
        outcome = secure.run(tasks)
        for client in sampled:
            coordinator.clear_task(client)  # nothing more is awaited from it this round
            if client.client_id in outcome.named:  # it costs its own session, from now on
                coordinator.exclude(client)
        collected = Collected(
            results=outcome.results,
            failures=outcome.failures,
            refused=outcome.refused,
            largest_norm=math.nan,  # masked: the coordinator never sees one update
            secure_clients=len(outcome.participants),
            secure_inputs=outcome.inputs,
        )
        if outcome.merged is None:
            return collected, f"kept previous adapter ({outcome.reason})"
        if len(outcome.participants) < fed.min_fit_clients:
            log.warning(
                "round %d: the secure sum holds %d clients' updates (need %d); keeping the "
                "previous global adapter",
                coordinator.round,
                len(outcome.participants),
                fed.min_fit_clients,
            )
            return collected, "kept previous adapter"
        by_id = {c.client_id: c for c in sampled}
        for client_id in outcome.participants:
            coordinator.took_part(by_id[client_id])
        step = coordinator.server_opt.propose(global_state, outcome.merged)  # the unmasked sum
        load_adapter_state(coordinator.model, step.weights)
        coordinator.server_opt.commit(step)
        return collected, "aggregated securely"
