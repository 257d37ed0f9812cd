"""The coordinator: admits clients, runs rounds, aggregates adapters, evaluates, checkpoints.

Each client connection is a netproto session whose thread reads that client's results and
heartbeats; the round loop (`run_rounds`) sends work and gathers results through queues.
A client silent for `heartbeat_timeout_s` is dead and left out of later rounds; one that joins
while training runs takes part from the next round on.

Nothing a client sends is trusted. A client has one task outstanding at most, and a RESULT is
taken only as the answer to it (matched by the task's random number, see `protocol`); anything
else is dropped, so each client's queue holds one answer at most. An answer is checked field
by field, its update for finite values, layout, the strategy's rules and a bound on its norm
(`fed.max_update_norm`), and its weight is capped by what the client declared at JOIN and by
`fed.max_examples_per_client` (`updates` holds the checks). A bad answer is that client's
failure in the round: logged, counted, and the round goes on with the others.

Who may join and how often, and the table of the clients connected now, are `admission`'s;
a checkpoint's roster lists only the clients whose updates a round took.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import random
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fed_learn.admission import Admission, ClientHandle, NotEnoughClientsError, Reply, Task
from fed_learn.aggregate import combiner
from fed_learn.async_rounds import run_async
from fed_learn.config import FedLearnRunConfig
from fed_learn.evaluation import ClientEvaluator, client_eval_summary
from fed_learn.lora import adapter_state, load_adapter_state
from fed_learn.privacy import Accountant, central_mean, run_noise_multiplier
from fed_learn.protocol import (
    ClientResult,
    FedMsg,
    answers,
    parse_evaluation,
    parse_result,
    printable,
)
from fed_learn.rounds import ATTEMPTS_PER_ROUND, FIRST_ROUND_GRACE_S, progress_bar, round_averages
from fed_learn.secure import InputDigests, SecureInbox, SecureRound, Skipped
from fed_learn.server_opt import ServerOptimizer
from fed_learn.strategy import Strategy
from fed_learn.updates import ANSWER_ERRORS, check_answer
from lab import atomic
from lab.cli import ConfigError
from lab.losses import evaluate
from lab.tracking import Tracker
from netproto import Connection, NetprotoError
from netproto.errors import peer_text

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest.json"
SERVER_OPT_FILE = "server_optimizer.safetensors"
POLL_S = 0.01
"""How often a round looks at its clients' answer queues when none had one."""
CLIENT_SENDS = frozenset(
    {FedMsg.RESULT, FedMsg.SA_KEYS, FedMsg.SA_SHARES, FedMsg.SA_REVEAL, FedMsg.SKIP}
    | {FedMsg.EVAL_RESULT}
)
"""What a client's session may read between rounds' answers (a RESULT opens one)."""


class Coordinator:
    def __init__(self, settings: FedLearnRunConfig, model: Any, val_blocks: torch.Tensor) -> None:
        self.settings = settings
        self.fed = settings.fed
        self.model = model
        self.val_blocks = val_blocks
        self.strategy = Strategy.create(
            self.fed.strategy,
            prox_mu=self.fed.prox_mu,
            rank=settings.lora.r,
            combine=combiner(self.fed.aggregator, trim_fraction=self.fed.trim_fraction),
        )
        self.server_opt = ServerOptimizer.create(
            self.fed.server_optimizer,
            lr=self.fed.server_lr,
            beta1=self.fed.server_beta1,
            beta2=self.fed.server_beta2,
            tau=self.fed.server_tau,
        )
        """Turns each round's aggregate into the next global adapter (fed.server_optimizer)."""
        self.admission = Admission(self.fed)
        self.evaluator = ClientEvaluator(self)
        """Federated evaluation on the clients' own held-out data (fed.evaluate_on_clients)."""
        self.clients = self.admission.clients
        """The clients connected now (a client that leaves is dropped): read it under _lock."""
        self.roster: dict[int, dict[str, Any]] = {}
        """Every client whose update a round took, for checkpoints: id, name, examples and
        the rounds it took part in (small records: no connection is kept)."""
        self.round = 0
        self.history: list[dict[str, float]] = []
        """Every finished round's metrics, those before a resume included (checkpointed)."""
        self.initial_loss: float | None = None
        """The global adapter's validation loss before the first round (kept across resumes)."""
        self._lock = self.admission.lock  # one lock for the client table and what rounds share
        self._finished = threading.Event()
        self.accountant = Accountant(self.fed.dp.accountant) if self.fed.dp.enabled else None
        """DP: the privacy spent over the rounds run (fed_learn.privacy)."""
        self.noise_multiplier = 0.0
        self.secure_inbox = SecureInbox()
        self.input_digests = InputDigests()
        """Every masked input taken in this run, by digest: a replay is refused by name."""
        self.excluded: set[int] = set()
        """Clients a secure round refused by name: left out of the run's later rounds."""
        """A secure round's step messages, from the sessions to the round (fed_learn.secure)."""
        self.checkpoint_dir = settings.paths.run_path / CHECKPOINTS

    # ------------------------------------------------------------ sessions (one per client)

    def handle(self, conn: Connection) -> None:
        """A client's session: its JOIN (see `admission`), then its answers until it leaves."""
        client = self.admission.admit(conn, at_round=lambda: self.round)
        if client is None:
            return
        timeout_s = self.fed.heartbeat_timeout_s
        try:
            while True:  # heartbeats (PINGs) are answered inside recv; silence means dead
                message = conn.recv(expect=CLIENT_SENDS, timeout_s=timeout_s)
                body = message.payload
                if message.type == FedMsg.SKIP:  # in clear: it sits this secure round out
                    reason = body.get("reason") if isinstance(body, dict) else None
                    skipped = Skipped(printable(reason if isinstance(reason, str) else "?"))
                    self._hand_in_secure(client, FedMsg.SA_MASKED, skipped, body)
                    continue
                if message.type == FedMsg.EVAL_RESULT:  # federated evaluation's answer
                    self._hand_in(client, body, {}, evaluate=True)
                    continue
                if message.type != FedMsg.RESULT:  # a secure round's step
                    self._hand_in_secure(client, message.type, body, body)
                    continue
                update = conn.recv(expect={FedMsg.UPDATE, FedMsg.SA_MASKED}, timeout_s=timeout_s)
                if update.type == FedMsg.UPDATE:
                    self._hand_in(client, body, update.payload)
                else:
                    masked = {k: v.clone() for k, v in update.payload.items()}
                    if self._hand_in_secure(client, FedMsg.SA_MASKED, (body, masked), body):
                        with self._lock:
                            self.admission.took_update(client)
        finally:
            self.admission.leave(client)
            self.secure_inbox.leave(client.client_id)
            if self._finished.is_set():
                log.info("%s (id %d) left", client.name, client.client_id)
            else:
                log.warning("%s (id %d) is gone", client.name, client.client_id)

    def _hand_in(
        self,
        client: ClientHandle,
        payload: Any,
        update: dict[str, torch.Tensor],
        *,
        evaluate: bool = False,
    ) -> None:
        """Queue a RESULT + UPDATE (`evaluate`: an EVAL_RESULT) as the answer to `client`'s
        outstanding task, checked; drop it if it answers none (the connection reuses its
        buffers: kept tensors are copied)."""
        with self._lock:
            task = client.task
        if task is not None and answers(payload, task.number) and task.evaluate == evaluate:
            number, version = task.number, task.round
            try:
                if evaluate:
                    declared = client.eval_tokens  # at JOIN: the most it may count
                    checked = parse_evaluation(
                        payload, task=number, round_index=version, declared_tokens=declared
                    )
                    reply = Reply(task, None, {}, evaluation=checked)
                else:
                    result = parse_result(payload, task=number, round_index=version)
                    reply = Reply(task, result, {k: v.clone() for k, v in update.items()})
            except ValueError as exc:
                reply = Reply(task, None, {}, error=str(exc))
            with self._lock:
                if client.task is task:  # not withdrawn meanwhile (the round ended)
                    client.task = None
                    if not evaluate:
                        self.admission.took_update(client)
                    client.results.put_nowait(reply)
                    return
        with self._lock:
            client.dropped += 1
            dropped = client.dropped
        if dropped & (dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood stays a trickle
            log.warning(
                "%s (id %d): dropped a RESULT that answers no outstanding task "
                "(unsolicited, duplicate or late; %d so far)",
                client.name,
                client.client_id,
                dropped,
            )

    def _hand_in_secure(self, client: ClientHandle, kind: int, payload: Any, body: Any) -> bool:
        """A secure round's step message (`body`: the JSON naming its task): to the round if it
        answers `client`'s task there (once per step), else dropped as a stray RESULT is.
        Whether the round took it."""
        task = body.get("task") if isinstance(body, dict) else None
        if self.secure_inbox.offer(client.client_id, kind, payload, task=task):
            return True
        with self._lock:
            client.dropped += 1
            dropped = client.dropped
        if dropped & (dropped - 1) == 0:
            log.warning(
                "%s (id %d): dropped a secure-round message that answers no step of its task "
                "(%d so far)",
                client.name,
                client.client_id,
                dropped,
            )
        return False

    def alive_clients(self) -> list[ClientHandle]:
        return self.admission.alive()

    def wait_for_clients(
        self, count: int, *, hoped: int = 0, grace_s: float = 0.0
    ) -> list[ClientHandle]:
        """See `Admission.wait_for`."""
        return self.admission.wait_for(count, hoped=hoped, grace_s=grace_s)

    # ------------------------------------------------------------ rounds

    def _send_task(
        self,
        client: ClientHandle,
        version: int,
        global_state: dict[str, torch.Tensor],
        *,
        number: int | None = None,
        extra: dict[str, Any] | None = None,
        evaluate: bool = False,
    ) -> Task | None:
        """Ask `client` to train from `global_state` (tagged `version`), withdrawing any task
        it still had; the task, or None if the client is unreachable. `number`: the task's
        number, drawn beforehand (a secure round listens for it before the TASK goes out);
        `extra`: more fields for the TASK; `evaluate`: send an EVALUATE instead."""
        number = secrets.randbelow(2**53) if number is None else number
        task = Task(number=number, round=version, evaluate=evaluate)
        with self._lock:
            if not client.alive:
                return None
            while True:  # answers to a withdrawn task that slipped in: no longer wanted
                try:
                    stale = client.results.get_nowait()
                except queue.Empty:
                    break
                if stale is None:  # the client is gone: keep the marker for whoever waits
                    client.results.put_nowait(None)
                    return None
            client.task = task
        message = {
            "task": task.number,
            "round": version,
            "strategy": self.fed.strategy,
            "local_epochs": self.fed.local_epochs,
            "local_steps": self.fed.local_steps,
            "batch_size": self.fed.batch_size,
            "lr": self.fed.lr,
            "compression": self.fed.compression,
            "topk_fraction": self.fed.topk_fraction,
            **self.strategy.client_options(),
            **(extra or {}),
        }
        if client.holds_frozen:
            trained = self.strategy.trained(global_state)
            global_state = {name: global_state[name] for name in trained}
        if evaluate:
            message = {"task": task.number, "round": version}
        try:
            client.conn.send_msg(FedMsg.EVALUATE if evaluate else FedMsg.TASK, message)
            client.conn.send_tensors(FedMsg.GLOBAL, global_state)
            client.holds_frozen = True
        except NetprotoError as exc:
            log.warning("version %d: cannot reach client %d: %s", version, client.client_id, exc)
            self._withdraw(client, task)
            return None
        return task

    def _withdraw(self, client: ClientHandle, task: Task) -> None:
        """`task` is no longer wanted: an answer to it arriving from now on is dropped."""
        with self._lock:
            if client.task is task:
                client.task = None

    def _initial_loss(self, tracker: Tracker, start: int) -> float:
        """The validation loss before the first round: measured and logged (at step 0) by a
        run that starts there, the first run's by one that resumes (nothing logged twice)."""
        if self.initial_loss is None:
            self.initial_loss = evaluate(self.model, self.val_blocks)
            tracker.log({"val_loss": self.initial_loss}, step=start)
        return self.initial_loss

    def _rounds_to_run(self) -> range:
        """The rounds (0-based) this run is to run, in both modes: from the one after the last
        checkpoint with fed.resume (whose adapter this loads), else from the first, up to
        fed.rounds. A change to how rounds are counted (resume, an early stop) goes here."""
        start = self.resume() if self.fed.resume else 0
        return range(start, self.fed.rounds)

    def run_rounds(self, tracker: Tracker) -> dict[str, float]:
        if self.fed.mode == "async":
            return run_async(self, tracker)
        rounds = self._rounds_to_run()
        rng = random.Random(self.settings.seed)
        history = self.history
        initial_loss = self._initial_loss(tracker, rounds.start)
        if self.fed.dp.enabled:
            self.noise_multiplier = run_noise_multiplier(self.fed)
        attempts, round_index = 0, rounds.start
        while round_index < rounds.stop:
            if attempts >= ATTEMPTS_PER_ROUND * self.fed.rounds:
                self._finish_clients()
                raise NotEnoughClientsError(
                    f"{attempts} round attempts ({ATTEMPTS_PER_ROUND} x fed.rounds) and only "
                    f"{round_index - rounds.start} of {len(rounds)} rounds had an update: "
                    "the clients sampled left or failed before sending one"
                )
            attempts += 1
            self.round = round_index  # sessions read it: a client joining now starts next round
            first = round_index == rounds.start  # give the whole roster a moment to join
            alive = self.wait_for_clients(
                self.fed.min_fit_clients,
                hoped=self.fed.num_clients if first else 0,
                grace_s=min(FIRST_ROUND_GRACE_S, self.fed.wait_clients_s) if first else 0.0,
            )
            alive = [c for c in alive if c.client_id not in self.excluded]
            size = max(self.fed.min_fit_clients, math.ceil(self.fed.fraction_fit * len(alive)))
            sampled = sorted(rng.sample(alive, min(size, len(alive))), key=lambda c: c.client_id)
            # The round's clock starts here, not while waiting for clients to join; the
            # coordinator's own share is sending the adapter, aggregating, evaluating and
            # checkpointing, against the clients' local training it waits for.
            started = time.perf_counter()
            global_state = adapter_state(self.model)
            traffic_before = self.admission.traffic(sampled)
            if self.fed.secure_aggregation:
                collected, outcome, coordinator_s = self._secure_round(sampled, global_state)
                aggregate_started = time.perf_counter()
            else:
                tasks = {c.client_id: self._send_task(c, self.round, global_state) for c in sampled}
                coordinator_s = time.perf_counter() - started
                collected = self._collect(sampled, tasks, global_state)
                aggregate_started = time.perf_counter()
            updates, results = collected.updates, collected.results
            if collected.arrived == 0:
                log.warning(
                    "round %d: no update came (%d sampled clients failed or left): attempt %d "
                    "of at most %d, not counted as a round",
                    self.round + 1,
                    len(collected.failures),
                    attempts,
                    ATTEMPTS_PER_ROUND * self.fed.rounds,
                )
                continue
            self.admission.round_counted()
            round_index += 1
            if self.fed.secure_aggregation:
                pass  # the round unmasked its sum and loaded it (or said why not)
            elif len(updates) >= self.fed.min_fit_clients:
                outcome = self._aggregate(updates, global_state, sampled)
            else:
                outcome = "kept previous adapter"
                log.warning(
                    "round %d: only %d of %d clients returned updates (need %d); "
                    "keeping the previous global adapter",
                    self.round,
                    len(updates),
                    len(sampled),
                    self.fed.min_fit_clients,
                )
            val_loss = evaluate(self.model, self.val_blocks)
            traffic = self.admission.traffic(sampled)
            metrics = {
                "val_loss": val_loss,
                "clients": float(collected.clients),
                "failures": float(len(collected.failures)),
                "refused": float(collected.refused),
                "largest_update_norm": collected.largest_norm,
                "bytes_down": float(traffic[0] - traffic_before[0]),
                "bytes_up": float(traffic[1] - traffic_before[1]),
                "client_train_loss": (
                    sum(r.train_loss for r in results) / len(results) if results else float("nan")
                ),
            }
            if self.accountant is not None:  # the round's privacy, spent: logged
                rate = len(sampled) / len(alive)
                metrics["dp_epsilon"] = self.accountant.spend(
                    self.noise_multiplier, rate, self.fed.dp.delta
                )
            coordinator_s += time.perf_counter() - aggregate_started
            if self.evaluator.due(self.round, last=rounds.stop - 1):
                metrics.update(self.evaluator.run(adapter_state(self.model)))
            history.append(
                self._close_round(
                    metrics, outcome=outcome, started=started, coordinator_s=coordinator_s
                )
            )
            tracker.log(metrics, step=self.round + 1)
            log.info(
                "round %d/%d: %s from %d clients, val loss %.4f",
                self.round + 1,
                rounds.stop,
                outcome,
                collected.clients,
                val_loss,
            )
        self._finish_clients()
        final = history[-1] if history else {"val_loss": initial_loss}
        return {
            "initial_val_loss": initial_loss,
            "final_val_loss": final["val_loss"],
            "rounds": float(len(history)),  # the whole run's, rounds before a resume included
            "refused": sum(h["refused"] for h in history),
            "dropped_results": float(self.admission.dropped_results()),
            **round_averages(history),
            **self._privacy_summary(),
            **client_eval_summary(history),
        }

    def _secure_round(
        self, sampled: list[ClientHandle], global_state: dict[str, torch.Tensor]
    ) -> tuple[Collected, str, float]:
        """A round under secure aggregation (fed_learn.secure): the answers as a plain round
        counts them, its outcome, and the coordinator's own seconds in it."""
        fed = self.fed
        trained = {name: global_state[name] for name in sorted(self.strategy.trained(global_state))}
        secure = SecureRound.for_round(
            fed,
            self.secure_inbox,
            sampled,
            trained,
            self.round,
            self.noise_multiplier,
            digests=self.input_digests,
        )
        numbers = {c.client_id: secrets.randbelow(2**53) for c in sampled}
        self.secure_inbox.open(numbers)
        tasks: dict[int, int] = {}
        for client in sampled:
            task = self._send_task(
                client,
                self.round,
                global_state,
                number=numbers[client.client_id],
                extra=secure.task_fields(client.client_id),
            )
            if task is not None:
                tasks[client.client_id] = task.number
        outcome = secure.run(tasks)
        for client in sampled:
            with self._lock:
                client.task = None  # nothing more is awaited from it in this round
            if client.client_id in outcome.named:  # it costs its own session, from now on
                self.excluded.add(client.client_id)
                log.warning(
                    "round %d: client %d (%s) is excluded from the run's later rounds",
                    self.round,
                    client.client_id,
                    client.name,
                )
                client.conn.interrupt()
        collected = Collected(
            results=outcome.results,
            failures=outcome.failures,
            refused=outcome.refused,
            largest_norm=math.nan,  # masked: the coordinator never sees one update
            secure_clients=len(outcome.participants),
            secure_inputs=outcome.inputs,
        )
        if outcome.merged is None:
            return collected, f"kept previous adapter ({outcome.reason})", secure.coordinator_s
        if len(outcome.participants) < fed.min_fit_clients:
            log.warning(
                "round %d: the secure sum holds %d clients' updates (need %d); keeping the "
                "previous global adapter",
                self.round,
                len(outcome.participants),
                fed.min_fit_clients,
            )
            return collected, "kept previous adapter", secure.coordinator_s
        for client_id in outcome.participants:
            client = next(c for c in sampled if c.client_id == client_id)
            self._took_part(client)
        step = self.server_opt.propose(global_state, outcome.merged)  # on the unmasked sum
        load_adapter_state(self.model, step.weights)
        self.server_opt.commit(step)
        return collected, "aggregated securely", secure.coordinator_s

    def _privacy_summary(self) -> dict[str, float]:
        if self.accountant is None:
            return {}
        return {
            "dp_epsilon": self.accountant.epsilon(self.fed.dp.delta),
            "dp_delta": self.fed.dp.delta,
            "dp_noise_multiplier": self.noise_multiplier,
        }

    def _aggregate(
        self,
        updates: list[tuple[dict[str, torch.Tensor], int]],
        global_state: dict[str, torch.Tensor],
        sampled: list[ClientHandle],
    ) -> str:
        """Load the strategy's aggregate of `updates` as the global adapter; the round's
        outcome (the previous adapter stays if they cannot be aggregated). With DP, the
        clipped, noised mean of their updates instead (`privacy.central_mean`)."""
        try:  # admitted updates always should: if not, say so loudly and go on
            if self.fed.dp.enabled:
                trained = {n: global_state[n] for n in self.strategy.trained(global_state)}
                weights = [c.num_examples for c in sampled]
                merged = {
                    **global_state,
                    **central_mean(updates, trained, self.fed.dp, self.noise_multiplier, weights),
                }
            else:
                merged = self.strategy.aggregate(updates)
            step = self.server_opt.propose(global_state, merged)  # fed.server_optimizer
            merged = step.weights
            if not all(bool(torch.isfinite(t).all()) for t in merged.values()):
                raise ValueError("the aggregate is not finite")
        except ValueError as exc:
            log.error(
                "round %d: aggregation failed (%s); keeping the previous adapter", self.round, exc
            )
            return "kept previous adapter (aggregation failed)"
        load_adapter_state(self.model, merged)
        self.server_opt.commit(step)
        return "aggregated"

    def _took_part(self, client: ClientHandle) -> None:
        """A round took `client`'s update: it is on the checkpoints' roster from now on."""
        with self._lock:
            entry = self.roster.setdefault(
                client.client_id,
                {
                    "client_id": client.client_id,
                    "name": client.name,
                    "num_examples": client.num_examples,
                    "rounds": 0,
                },
            )
            entry["rounds"] += 1

    def _finish_clients(self) -> None:
        """Tell every live client that training is over (it then exits)."""
        self._finished.set()
        for client in self.alive_clients():
            with contextlib.suppress(NetprotoError):
                client.conn.send(FedMsg.FINISH)

    def _close_round(
        self, metrics: dict[str, float], *, outcome: str, started: float, coordinator_s: float
    ) -> dict[str, float]:
        """Checkpoint round `self.round` and complete its metrics: perplexity, the round's
        length since `started`, and the coordinator's own share of it (`coordinator_s` of
        its work so far, plus the checkpoint). Returns `metrics`."""
        metrics["val_perplexity"] = math.exp(min(metrics["val_loss"], 50.0))
        checkpoint_started = time.perf_counter()
        metrics["round_s"] = checkpoint_started - started  # as the checkpoint keeps it
        metrics["coordinator_share"] = coordinator_s / metrics["round_s"]
        self.checkpoint(metrics, outcome=outcome)
        coordinator_s += time.perf_counter() - checkpoint_started
        metrics["round_s"] = time.perf_counter() - started
        metrics["coordinator_share"] = coordinator_s / metrics["round_s"]
        return metrics

    def _collect(
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
        deadline = time.monotonic() + self.fed.round_timeout_s
        need = self.fed.min_fit_clients
        collected = Collected()
        waiting = {c.client_id: (c, t) for c in sampled if (t := tasks[c.client_id]) is not None}
        collected.failures += [c.client_id for c in sampled if tasks[c.client_id] is None]
        asked = {c.client_id for c in sampled}
        with progress_bar() as progress:  # transient: gone once the round is
            bar = progress.add_task(f"round {self.round + 1}", total=len(asked))
            while time.monotonic() < deadline:
                for client in self.alive_clients():  # top up: those asked left or failed
                    if len(collected.updates) + len(waiting) >= need:
                        break
                    if client.client_id in asked or client.client_id in self.excluded:
                        continue
                    asked.add(client.client_id)
                    sampled.append(client)
                    task = self._send_task(client, self.round, global_state)
                    if task is not None:
                        waiting[client.client_id] = (client, task)
                progress.update(bar, total=len(asked))
                if not waiting and len(collected.updates) >= need:
                    break
                arrived = False
                for client_id, (client, task) in list(waiting.items()):
                    try:
                        reply = client.results.get_nowait()
                    except queue.Empty:
                        continue
                    if reply is None:  # gone for good: the marker stays for whoever waits next
                        client.results.put_nowait(None)
                    elif reply.task is not task:
                        continue  # answers a task withdrawn earlier: not wanted
                    arrived = True
                    del waiting[client_id]
                    self._withdraw(client, task)
                    progress.advance(bar)
                    if reply is None:
                        collected.failures.append(client_id)
                    else:
                        self._take(client, reply, global_state, collected)
                if not arrived:
                    time.sleep(POLL_S)
        for client, task in waiting.values():  # too late
            self._withdraw(client, task)
            collected.failures.append(client.client_id)
        return collected

    def _take(
        self,
        client: ClientHandle,
        reply: Reply,
        global_state: dict[str, torch.Tensor],
        collected: Collected,
    ) -> None:
        """Admit `client`'s answer into `collected`, or refuse it (its failure, counted)."""
        try:
            result, update, norm = check_answer(
                reply, global_state, strategy=self.strategy, fed=self.fed
            )
        except ANSWER_ERRORS as exc:
            log.warning(
                "round %d: refused client %d's answer: %s",
                self.round,
                client.client_id,
                peer_text(exc),
            )
            collected.failures.append(client.client_id)
            collected.refused += 1
            return
        collected.results.append(result)
        collected.updates.append((update, self._weight(client, result)))
        self._took_part(client)
        collected.largest_norm = max(collected.largest_norm, norm)

    @staticmethod
    def _await_reply(client: ClientHandle, task: Task, deadline: float) -> Reply | None:
        """`client`'s answer to `task`, or None if it is gone or the deadline passes first."""
        while True:
            try:
                reply = client.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if reply is None:
                client.results.put_nowait(None)  # gone for good: for whoever waits next
                return None
            if reply.task is task:
                return reply

    def _weight(self, client: ClientHandle, result: ClientResult) -> int:
        """The examples `client` is credited with: at most what it declared at JOIN (itself
        capped by fed.max_examples_per_client)."""
        if result.num_examples > client.num_examples:
            log.warning(
                "round %d: client %d claims %d examples; credited with %d",
                self.round,
                client.client_id,
                result.num_examples,
                client.num_examples,
            )
        return min(result.num_examples, client.num_examples)

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, metrics: dict[str, float], *, outcome: str) -> Path:
        """Round k's global adapter in PEFT's format + state, written then renamed (atomic)."""
        final = self.checkpoint_dir / f"round_{self.round + 1:04d}"
        with self._lock:  # sessions add and drop clients meanwhile
            roster = [
                {**entry, "alive": client_id in self.clients}
                for client_id, entry in self.roster.items()
            ]
        config = asdict(self.settings)
        config["cluster"]["secret"] = None  # never written to disk
        state = {
            "round": self.round + 1,
            "outcome": outcome,
            "metrics": metrics,
            "history": [*self.history, metrics],  # a resumed run's tables cover the whole run
            "initial_val_loss": self.initial_loss,
            "roster": roster,
            "config": config,
            "dp_history": self.accountant.state() if self.accountant is not None else [],
            "server_optimizer": self.server_opt.describe(),
        }
        with atomic.staged_dir(final) as staging:
            self.model.save_pretrained(staging)  # adapter_model.safetensors + adapter_config
            if moments := self.server_opt.state_tensors():  # restored on resume
                save_file(moments, str(staging / SERVER_OPT_FILE))
            (staging / "fed_state.json").write_text(json.dumps(state, indent=2, default=str))
        pointer = {"round": self.round + 1, "path": final.name}
        atomic.write_text(self.checkpoint_dir / LATEST, json.dumps(pointer))
        return final

    def resume(self) -> int:
        """Load the last completed round's adapter; returns the round to run next."""
        latest = self.checkpoint_dir / LATEST
        if not latest.is_file():
            log.info(
                "fed.resume=true but no checkpoint in %s: starting at round 1", self.checkpoint_dir
            )
            return 0
        pointer = json.loads(latest.read_text())
        folder = self.checkpoint_dir / pointer["path"]
        load_adapter_state(self.model, load_file(str(folder / "adapter_model.safetensors")))
        state = json.loads((folder / "fed_state.json").read_text())
        self.history = [dict(h) for h in state.get("history", [])]
        if self.accountant is not None:  # the privacy already spent stays spent
            self.accountant.restore(state.get("dp_history", []))
        moments = folder / SERVER_OPT_FILE
        try:  # the server optimizer's moments and step count: it goes on as if never stopped
            self.server_opt.restore(
                state.get("server_optimizer", {"name": "none"}),
                load_file(str(moments)) if moments.is_file() else {},
            )
        except ValueError as exc:
            raise ConfigError(f"fed.resume=true from {folder}: {exc}") from exc
        initial = state.get("initial_val_loss")
        self.initial_loss = float(initial) if isinstance(initial, (int, float)) else None
        # the adapter it loaded, on the same held-out text: the saved round's loss again
        log.info("resumed from %s (round %d): validation loss %.6f, saved %.6f", folder,
                 pointer["round"], evaluate(self.model, self.val_blocks),
                 float(state["metrics"]["val_loss"]))  # fmt: skip
        return int(pointer["round"])


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
