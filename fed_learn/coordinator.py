"""The coordinator: its clients' sessions, their tasks, the global adapter and checkpoints.

Each client connection is a netproto session whose thread reads that client's results and
heartbeats; a round driver (`fed_learn.drivers`: plain, secure or async, as the settings pick)
runs the rounds, sending work and gathering results through queues.
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
import secrets
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fed_learn import async_rounds  # noqa: F401 (registers the async driver)
from fed_learn.admission import Admission, ClientHandle, Reply, Task
from fed_learn.aggregate import combiner
from fed_learn.config import FedLearnRunConfig
from fed_learn.drivers import CpuClock, RoundDriver
from fed_learn.evaluation import ClientEvaluator
from fed_learn.lora import adapter_state, load_adapter_state, peft_state, saves_embeddings
from fed_learn.privacy import Accountant, DPMean, run_noise_multiplier
from fed_learn.protocol import (
    ClientResult,
    FedMsg,
    answers,
    parse_evaluation,
    parse_result,
    printable,
)
from fed_learn.rounds import logged_steps, unlogged_rounds
from fed_learn.secure_inbox import InputDigests, SecureInbox, Skipped
from fed_learn.server_opt import ServerOptimizer
from fed_learn.strategy import Strategy
from lab import atomic
from lab.cli import ConfigError
from lab.losses import evaluate
from lab.records import METRICS_FILE
from lab.tracking import Tracker
from netproto import Connection, EncodedFrame, NetprotoError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest.json"
SERVER_OPT_FILE = "server_optimizer.safetensors"
MODEL_CARD = "README.md"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
FRAMES_KEPT = 2
"""GLOBAL frames kept for reuse: the adapter clients are sent now, whole and trained-only (a
copy of the adapter each: an older one is dropped, and encoded again if it is sent again)."""
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
        if self.fed.dp.enabled and not self.fed.secure_aggregation:  # else clients add noise
            self.strategy = DPMean(self.strategy, dp=self.fed.dp)
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
        peft_state(model)  # which parameters the adapter is, found now: start-up, not round 1
        self._frames: dict[tuple[int, bool], tuple[dict[str, torch.Tensor], EncodedFrame]] = {}
        """The GLOBAL frames sent lately, by their state (`_global_frame`)."""
        self._frames_lock = threading.Lock()
        self._peft_files: dict[str, bytes] = {}
        """The model card and adapter config as PEFT renders them (`_render_peft_files`): every
        checkpoint writes them as they are (`_save_adapter`)."""

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
                else:  # (received tensors are the frame's own: netproto never reuses them)
                    masked = dict(update.payload)
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
        outstanding task, checked; drop it if it answers none. The update's tensors are kept
        as received, not copied: netproto's received tensors are never overwritten while held
        (a big frame's buffer is reused only once nothing views it, and only for a frame at
        least half its size; a small one's copied out)."""
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
                    reply = Reply(task, result, dict(update))
            except ValueError as exc:
                reply = Reply(task, None, {}, error=str(exc))
            with self._lock:
                if client.task is task:  # not withdrawn meanwhile (the round ended)
                    client.task = None
                    if not evaluate:
                        self.admission.took_update(client)
                    client.results.put_nowait(reply)
                    self.admission.news.put(client.client_id)
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

    def send_task(
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
        if evaluate:
            message = {"task": task.number, "round": version}
        try:
            frame = self._global_frame(client.conn, global_state, trained=client.holds_frozen)
            client.conn.send_msg(FedMsg.EVALUATE if evaluate else FedMsg.TASK, message)
            client.conn.send_encoded(frame)
            client.holds_frozen = True
        except NetprotoError as exc:
            log.warning("version %d: cannot reach client %d: %s", version, client.client_id, exc)
            self.withdraw(client, task)
            return None
        return task

    def _global_frame(
        self, conn: Connection, state: dict[str, torch.Tensor], *, trained: bool
    ) -> EncodedFrame:
        """GLOBAL's frame of `state` (`trained`: only the tensors the strategy trains, for a
        client that holds the rest), encoded once for every client it goes to. The states
        sent are `adapter_state`'s fresh copies, never changed in place: one is known by its
        identity (the last FRAMES_KEPT kept, with the state itself, so no id is reused)."""
        key = (id(state), trained)
        with self._frames_lock:
            kept = self._frames.get(key)
            if kept is not None and kept[0] is state:
                return kept[1]
        sent = {n: state[n] for n in self.strategy.trained(state)} if trained else state
        frame = conn.encode(FedMsg.GLOBAL, sent)
        with self._frames_lock:
            self._frames[key] = (state, frame)
            while len(self._frames) > FRAMES_KEPT:
                del self._frames[next(iter(self._frames))]
        return frame

    def withdraw(self, client: ClientHandle, task: Task) -> None:
        """`task` is no longer wanted: an answer to it arriving from now on is dropped."""
        with self._lock:
            if client.task is task:
                client.task = None

    def clear_task(self, client: ClientHandle) -> None:
        """Nothing more is awaited from `client` in this round, whatever its task was."""
        with self._lock:
            client.task = None

    def exclude(self, client: ClientHandle) -> None:
        """A client a round refused by name: out of the run's later rounds, its session ended."""
        self.excluded.add(client.client_id)
        log.warning(
            "round %d: client %d (%s) is excluded from the run's later rounds",
            self.round,
            client.client_id,
            client.name,
        )
        client.conn.interrupt()

    def initial_val_loss(self, tracker: Tracker, start: int) -> float:
        """The validation loss before the first round: measured and logged (at step 0) by a
        run that starts there, the first run's by one that resumes (nothing logged twice)."""
        if self.initial_loss is None:
            self.initial_loss = evaluate(self.model, self.val_blocks)
            tracker.log({"val_loss": self.initial_loss}, step=start)
        if start:  # resumed: a round checkpointed but not logged before the crash is logged now
            logged = logged_steps(tracker.run_dir / METRICS_FILE)
            for step, metrics in unlogged_rounds(self.history, start, logged):
                log.warning(
                    "round %d: checkpointed but not logged before the stop: logged now", step
                )
                tracker.log(metrics, step=step)
        return self.initial_loss

    def rounds_to_run(self) -> range:
        """The rounds (0-based) this run is to run, in both modes: from the one after the last
        checkpoint with fed.resume (whose adapter this loads), else from the first, up to
        fed.rounds. A change to how rounds are counted (resume, an early stop) goes here."""
        start = self.resume() if self.fed.resume else 0
        return range(start, self.fed.rounds)

    def run_rounds(self, tracker: Tracker) -> dict[str, float]:
        """The run's rounds, by the driver its settings pick (`fed_learn.drivers`)."""
        if self.fed.dp.enabled:
            self.noise_multiplier = run_noise_multiplier(self.fed)
            if isinstance(self.strategy, DPMean):
                self.strategy.noise_multiplier = self.noise_multiplier
        self._render_peft_files()
        return RoundDriver.create(self).run(tracker)

    def _render_peft_files(self) -> None:
        """PEFT's model card and adapter config, rendered once by its own `save_pretrained`
        (its call renders the card's template, ~15 ms): before the first round (`run_rounds`),
        or at the first checkpoint if none was. `_save_adapter` writes them as they are."""
        if not self._peft_files:
            with tempfile.TemporaryDirectory(prefix="peft-files-") as scratch:
                self.model.save_pretrained(
                    scratch, save_embedding_layers=saves_embeddings(self.model)
                )
                self._peft_files = {
                    n: (Path(scratch) / n).read_bytes() for n in (MODEL_CARD, ADAPTER_CONFIG)
                }

    def privacy_summary(self) -> dict[str, float]:
        if self.accountant is None:
            return {}
        return {
            "dp_epsilon": self.accountant.epsilon(self.fed.dp.delta),
            "dp_delta": self.fed.dp.delta,
            "dp_noise_multiplier": self.noise_multiplier,
        }

    def apply(
        self,
        updates: list[tuple[dict[str, torch.Tensor], int]],
        global_state: dict[str, torch.Tensor],
    ) -> str:
        """Load the strategy's aggregate of `updates`, stepped by the server optimizer, as the
        global adapter; the round's outcome (the previous adapter stays if they cannot be
        aggregated)."""
        try:  # admitted updates always should: if not, say so loudly and go on
            step = self.server_opt.propose(global_state, self.strategy.aggregate(updates))
            if not all(bool(torch.isfinite(t).all()) for t in step.weights.values()):
                raise ValueError("the aggregate is not finite")
        except ValueError as exc:
            log.error(
                "round %d: aggregation failed (%s); keeping the previous adapter", self.round, exc
            )
            return "kept previous adapter (aggregation failed)"
        load_adapter_state(self.model, step.weights)
        self.server_opt.commit(step)
        return "aggregated"

    def took_part(self, client: ClientHandle) -> None:
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

    def finish_clients(self) -> None:
        """Tell every live client that training is over (it then exits)."""
        self._finished.set()
        for client in self.alive_clients():
            with contextlib.suppress(NetprotoError):
                client.conn.send(FedMsg.FINISH)

    def close_round(
        self, metrics: dict[str, float], *, outcome: str, clock: CpuClock
    ) -> dict[str, float]:
        """Checkpoint round `self.round` and complete its metrics: perplexity, the round's
        length, the coordinator's CPU milliseconds in it and their share of that length
        (`clock` started with the round; the checkpoint counted). Returns `metrics`."""
        metrics["val_perplexity"] = math.exp(min(metrics["val_loss"], 50.0))
        for checkpointed in (False, True):  # the checkpoint keeps the figures before its own
            if checkpointed:
                self.checkpoint(metrics, outcome=outcome)
            thread_s = clock.thread_s()  # read first: within the process's figure
            cpu_s, metrics["round_s"] = clock.read()
            metrics["coordinator_cpu_ms"] = 1000.0 * cpu_s
            if thread_s is not None:  # the round's own thread's part of it
                metrics["coordinator_thread_cpu_ms"] = 1000.0 * thread_s
            metrics["coordinator_share"] = cpu_s / metrics["round_s"]
        return metrics

    @staticmethod
    def await_reply(client: ClientHandle, task: Task, deadline: float) -> Reply | None:
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

    def credited_weight(self, client: ClientHandle, result: ClientResult) -> int:
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
            self._save_adapter(staging)
            if moments := self.server_opt.state_tensors():  # restored on resume
                save_file(moments, str(staging / SERVER_OPT_FILE))
            (staging / "fed_state.json").write_text(json.dumps(state, indent=2, default=str))
        pointer = {"round": self.round + 1, "path": final.name}
        atomic.write_text(self.checkpoint_dir / LATEST, json.dumps(pointer))
        return final

    def _save_adapter(self, folder: Path) -> None:
        """The global adapter as PEFT's `save_pretrained` writes it, into `folder`: its config
        and card as rendered once (`_render_peft_files`: neither changes over a run), the
        weights as it saves them (safetensors, format "pt"). PEFT's call each round would walk
        every module for the state dict and parse and re-dump the card's YAML, ~5 ms; the
        files are tested byte-equal to its own."""
        self._render_peft_files()
        for name, data in self._peft_files.items():
            (folder / name).write_bytes(data)
        weights = adapter_state(self.model)  # copies: none shares storage (safetensors refuses)
        save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})

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
        load_adapter_state(self.model, load_file(str(folder / ADAPTER_WEIGHTS)))
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
        log.info(
            "resumed from %s (round %d): validation loss %.6f, saved %.6f",
            folder,
            pointer["round"],
            evaluate(self.model, self.val_blocks),
            float(state["metrics"]["val_loss"]),
        )
        return int(pointer["round"])
