"""The coordinator: admits clients, runs rounds, aggregates adapters, evaluates, checkpoints.

Each client connection is a netproto session whose thread reads that client's results and
heartbeats; the round loop (`run_rounds`) sends work and gathers results through queues.
A client silent for `heartbeat_timeout_s` is dead and left out of later rounds; one that joins
while training runs takes part from the next round on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from fed_learn.compression import decompress
from fed_learn.config import FedLearnRunConfig
from fed_learn.lora import adapter_state, load_adapter_state
from fed_learn.protocol import FedMsg
from fed_learn.strategy import Strategy
from lab.pretrain import evaluate
from lab.tracking import Tracker
from netproto import Connection, NetprotoError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest.json"
FIRST_ROUND_GRACE_S = 30.0
"""Before round 1, how long to wait for all fed.num_clients (then min_fit_clients will do)."""


class NotEnoughClientsError(RuntimeError):
    """Fewer than `fed.min_fit_clients` clients connected within `fed.wait_clients_s`."""


@dataclass
class ClientHandle:
    client_id: int
    name: str
    num_examples: int
    conn: Connection
    joined_round: int
    alive: bool = True
    results: queue.Queue[tuple[dict[str, Any], dict[str, torch.Tensor]] | None] = field(
        default_factory=queue.Queue
    )


class Coordinator:
    def __init__(self, settings: FedLearnRunConfig, model: Any, val_blocks: torch.Tensor) -> None:
        self.settings = settings
        self.fed = settings.fed
        self.model = model
        self.val_blocks = val_blocks
        self.strategy = Strategy.create(
            self.fed.strategy, prox_mu=self.fed.prox_mu, rank=settings.lora.r
        )
        self.clients: dict[int, ClientHandle] = {}
        self.round = 0
        self._lock = threading.Lock()
        self._joined = threading.Condition(self._lock)
        self.checkpoint_dir = settings.paths.run_path / CHECKPOINTS

    # ------------------------------------------------------------ sessions (one per client)

    def handle(self, conn: Connection) -> None:
        join = conn.recv(expect=FedMsg.JOIN, timeout_s=self.fed.heartbeat_timeout_s)
        hello = join.payload
        num_examples = hello.get("num_examples")
        if not isinstance(num_examples, int) or num_examples < 1:
            conn.send_error(
                "bad_request", "JOIN needs num_examples >= 1", request_id=join.request_id
            )
            return
        with self._lock:
            client = ClientHandle(
                client_id=len(self.clients),
                name=str(hello.get("name", ""))[:64],
                num_examples=num_examples,
                conn=conn,
                joined_round=self.round,
            )
            self.clients[client.client_id] = client
            self._joined.notify_all()
        conn.send_msg(FedMsg.WELCOME, {"client_id": client.client_id}, request_id=join.request_id)
        log.info(
            "client %d (%s, %d examples) joined at round %d",
            client.client_id,
            client.name,
            num_examples,
            self.round,
        )
        try:
            while True:  # heartbeats (PINGs) are answered inside recv; silence means dead
                result = conn.recv_msg(FedMsg.RESULT, timeout_s=self.fed.heartbeat_timeout_s)
                update = conn.recv_tensors(FedMsg.UPDATE, timeout_s=self.fed.heartbeat_timeout_s)
                client.results.put((result, {k: v.clone() for k, v in update.items()}))
        finally:
            client.alive = False
            client.results.put(None)  # wakes a round waiting for this client
            log.warning("client %d (%s) is gone", client.client_id, client.name)

    def alive_clients(self) -> list[ClientHandle]:
        with self._lock:
            return [c for c in self.clients.values() if c.alive]

    def wait_for_clients(
        self, count: int, *, hoped: int = 0, grace_s: float = 0.0
    ) -> list[ClientHandle]:
        """Block until `count` clients are alive (NotEnoughClientsError after wait_clients_s).

        With `hoped` > count, first wait up to `grace_s` for that many (the expected roster).
        """
        grace_end = time.monotonic() + grace_s
        with self._lock:
            while (
                sum(c.alive for c in self.clients.values()) < hoped and time.monotonic() < grace_end
            ):
                self._joined.wait(timeout=max(0.0, min(grace_end - time.monotonic(), 1.0)))
        deadline = time.monotonic() + self.fed.wait_clients_s
        with self._lock:
            while sum(c.alive for c in self.clients.values()) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    alive = sum(c.alive for c in self.clients.values())
                    raise NotEnoughClientsError(
                        f"only {alive} of the {count} clients needed (fed.min_fit_clients) are "
                        f"connected after {self.fed.wait_clients_s:.0f}s"
                    )
                self._joined.wait(timeout=min(remaining, 1.0))
        return self.alive_clients()

    # ------------------------------------------------------------ rounds

    def run_rounds(self, tracker: Tracker) -> dict[str, float]:
        start = self.resume() if self.fed.resume else 0
        rng = random.Random(self.settings.seed)
        history: list[dict[str, float]] = []
        initial_loss = evaluate(self.model, self.val_blocks)
        tracker.log({"val_loss": initial_loss}, step=start)
        for round_index in range(start, self.fed.rounds):
            self.round = round_index  # sessions read it: a client joining now starts next round
            started = time.perf_counter()
            first = round_index == start  # give the whole roster a moment to join
            alive = self.wait_for_clients(
                self.fed.min_fit_clients,
                hoped=self.fed.num_clients if first else 0,
                grace_s=min(FIRST_ROUND_GRACE_S, self.fed.wait_clients_s) if first else 0.0,
            )
            size = max(self.fed.min_fit_clients, math.ceil(self.fed.fraction_fit * len(alive)))
            sampled = sorted(rng.sample(alive, min(size, len(alive))), key=lambda c: c.client_id)
            global_state = adapter_state(self.model)
            sent_before = {c.client_id: c.conn.bytes_sent for c in sampled}
            received_before = {c.client_id: c.conn.bytes_received for c in sampled}
            task = {
                "round": self.round,
                "strategy": self.fed.strategy,
                "local_epochs": self.fed.local_epochs,
                "local_steps": self.fed.local_steps,
                "batch_size": self.fed.batch_size,
                "lr": self.fed.lr,
                "compression": self.fed.compression,
                "topk_fraction": self.fed.topk_fraction,
                **self.strategy.client_options(),
            }
            for client in sampled:
                try:
                    client.conn.send_msg(FedMsg.TASK, task)
                    client.conn.send_tensors(FedMsg.GLOBAL, global_state)
                except NetprotoError as exc:
                    log.warning(
                        "round %d: cannot reach client %d: %s", self.round, client.client_id, exc
                    )
            updates, failures, results = self._collect(sampled, global_state)
            aggregate_started = time.perf_counter()
            if len(updates) >= self.fed.min_fit_clients:
                load_adapter_state(self.model, self.strategy.aggregate(updates))
                outcome = "aggregated"
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
            coordinator_s = time.perf_counter() - aggregate_started
            round_s = time.perf_counter() - started
            metrics = {
                "val_loss": val_loss,
                "val_perplexity": math.exp(min(val_loss, 50.0)),
                "clients": float(len(updates)),
                "failures": float(len(failures)),
                "bytes_down": float(
                    sum(c.conn.bytes_sent - sent_before[c.client_id] for c in sampled)
                ),
                "bytes_up": float(
                    sum(c.conn.bytes_received - received_before[c.client_id] for c in sampled)
                ),
                "client_train_loss": (
                    sum(r["train_loss"] for r in results) / len(results)
                    if results
                    else float("nan")
                ),
                "round_s": round_s,
                "coordinator_share": coordinator_s / round_s,
            }
            history.append(metrics)
            tracker.log(metrics, step=self.round + 1)
            self.checkpoint(metrics, outcome=outcome)
            log.info(
                "round %d/%d: %s from %d clients, val loss %.4f",
                self.round + 1,
                self.fed.rounds,
                outcome,
                len(updates),
                val_loss,
            )
        for client in self.alive_clients():
            with contextlib.suppress(NetprotoError):
                client.conn.send(FedMsg.FINISH)
        final = history[-1] if history else {"val_loss": initial_loss}
        return {
            "initial_val_loss": initial_loss,
            "final_val_loss": final["val_loss"],
            "rounds": float(self.fed.rounds - start),
            "mean_clients_per_round": (
                sum(h["clients"] for h in history) / len(history) if history else 0.0
            ),
            "bytes_up_per_round": (
                sum(h["bytes_up"] for h in history) / len(history) if history else 0.0
            ),
        }

    def _collect(
        self, sampled: list[ClientHandle], global_state: dict[str, torch.Tensor]
    ) -> tuple[list, list[int], list[dict]]:
        """Wait for the sampled clients' updates until the round's deadline."""
        deadline = time.monotonic() + self.fed.round_timeout_s
        updates, failures, results = [], [], []
        for client in tqdm(sampled, desc=f"round {self.round + 1}", unit="client", leave=False):
            try:
                item = client.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = None
            if item is None or item[0].get("round") != self.round:
                failures.append(client.client_id)
                continue
            result, update = item
            try:
                update = self._expand(update, global_state)
            except (KeyError, ValueError) as exc:
                log.warning(
                    "round %d: client %d sent a malformed update (%s)",
                    self.round,
                    client.client_id,
                    exc,
                )
                failures.append(client.client_id)
                continue
            results.append(result)
            updates.append((update, int(result["num_examples"])))
        return updates, failures, results

    def _expand(
        self, update: dict[str, torch.Tensor], global_state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """A client's full adapter: as sent, or global + its decompressed delta."""
        shapes = {name: tensor.shape for name, tensor in global_state.items()}
        if self.fed.compression == "none":
            if {n: t.shape for n, t in update.items()} != shapes:
                raise ValueError("adapter tensors do not match the global adapter's layout")
            return update
        delta = decompress(update, method=self.fed.compression, shapes=shapes)
        return {
            name: (global_state[name].float() + delta[name]).to(global_state[name].dtype)
            for name in shapes
        }

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self, metrics: dict[str, float], *, outcome: str) -> Path:
        """Round k's global adapter in PEFT's format + state, written then renamed (atomic)."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_dir / f"round_{self.round + 1:04d}"
        staging = self.checkpoint_dir / f".{final.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        self.model.save_pretrained(staging)  # adapter_model.safetensors + adapter_config.json
        roster = [
            {
                "client_id": c.client_id,
                "name": c.name,
                "num_examples": c.num_examples,
                "alive": c.alive,
            }
            for c in self.clients.values()
        ]
        config = asdict(self.settings)
        config["cluster"]["secret"] = None  # never written to disk
        state = {
            "round": self.round + 1,
            "outcome": outcome,
            "metrics": metrics,
            "roster": roster,
            "config": config,
        }
        (staging / "fed_state.json").write_text(json.dumps(state, indent=2, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        pointer = self.checkpoint_dir / f".{LATEST}.tmp"
        pointer.write_text(json.dumps({"round": self.round + 1, "path": final.name}))
        os.replace(pointer, self.checkpoint_dir / LATEST)
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
        log.info("resumed from %s (round %d)", folder, pointer["round"])
        return int(pointer["round"])
