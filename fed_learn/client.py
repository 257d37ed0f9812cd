"""A LoRA client: its private shard never leaves it; it sends only adapter tensors."""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from typing import Any

import torch

from fed_learn.aggregate import lora_modules
from fed_learn.compression import ErrorFeedback
from fed_learn.config import FedConfig, SecAggConfig
from fed_learn.lora import adapter_state, check_adapter_state, load_adapter_state, train_local
from fed_learn.privacy import run_noise_multiplier
from fed_learn.protocol import FedMsg, parse_task
from fed_learn.secagg import RoundFailed
from fed_learn.secagg_params import RoundFloor
from fed_learn.secure import RoundAbandoned, client_round
from lab.losses import evaluate
from netproto import Connection, MsgType, NetprotoError

log = logging.getLogger(__name__)


def round_floor(fed: FedConfig) -> RoundFloor:
    """The weakest round a client of `fed` takes part in: its own fed.secure_aggregation,
    fed.secagg.threshold and neighbors, fed.min_fit_clients, and under DP its noise (the run's
    multiplier, worked out from fed.dp as the coordinator does), clip_norm and weight_cap."""
    dp = fed.dp
    return RoundFloor(
        secure=fed.secure_aggregation,
        threshold=fed.secagg.threshold,
        neighbors=fed.secagg.neighbors,
        min_clients=max(2, fed.min_fit_clients),
        noise_multiplier=run_noise_multiplier(fed) if dp.enabled else 0.0,
        clip_norm=dp.clip_norm if dp.enabled else float("inf"),
        weight_cap=dp.weight_cap if dp.enabled else RoundFloor.weight_cap,
    )


def _round(task: object) -> object:
    """The task's round, counted from 1, for a log line (whatever the coordinator sent)."""
    number = task.get("round") if isinstance(task, dict) else None
    return number + 1 if type(number) is int else "?"


class LoRAClient:
    def __init__(
        self,
        model: Any,
        train_blocks: torch.Tensor,
        val_blocks: torch.Tensor,
        *,
        name: str,
        seed: int = 0,
        index: int | None = None,
        max_round_clients: int = SecAggConfig.max_clients,
        floor: RoundFloor | None = None,
    ) -> None:
        self.model = model
        self.train_blocks = train_blocks
        self.val_blocks = val_blocks
        self.name = name
        self.seed = seed
        self.index = index
        """The client index claimed at JOIN (None: none claimed)."""
        self.feedback = ErrorFeedback()
        self.rounds = 0
        """Rounds taken part in, over every session with the coordinator."""
        self.max_round_clients = max_round_clients
        """fed.secagg.max_clients: a secure round listing more is left before anything is built."""
        self.floor = round_floor(FedConfig()) if floor is None else floor
        """The weakest round taken part in (`round_floor` of the run's config; the defaults')."""

    def run(self, conn: Connection, *, heartbeat_s: float, timeout_s: float | None = None) -> int:
        """Join, then train whenever asked until FINISH; returns the rounds taken part in.

        While waiting for work the coordinator answers this client's heartbeats; `timeout_s`
        of silence from it raises NetTimeout (a coordinator whose host vanished sends no FIN).
        """
        stop = threading.Event()
        beat = threading.Thread(
            target=self._heartbeat, args=(conn, heartbeat_s, stop), daemon=True, name="heartbeat"
        )
        beat.start()
        try:
            welcome = conn.request(
                FedMsg.JOIN,
                {
                    "name": self.name,
                    "num_examples": len(self.train_blocks),
                    "eval_tokens": self.eval_tokens,
                    **({} if self.index is None else {"client_index": self.index}),
                },
                expect=FedMsg.WELCOME,
            ).payload
            log.info(
                "joined as client %d with %d examples", welcome["client_id"], len(self.train_blocks)
            )
            pending = None  # a TASK or FINISH that ended a secure round early
            while True:
                message = pending or conn.recv(
                    expect={FedMsg.TASK, FedMsg.FINISH, FedMsg.EVALUATE}, timeout_s=timeout_s
                )
                pending = None
                if message.type == FedMsg.FINISH:
                    return self.rounds
                task = message.payload
                global_state = conn.recv_tensors(FedMsg.GLOBAL, timeout_s=timeout_s)
                try:  # before anything is loaded, trained or sent
                    parse_task(task, evaluate=message.type == FedMsg.EVALUATE)
                    check_adapter_state(self.model, global_state)
                    if not task.get("secure") and message.type == FedMsg.TASK and self.floor.secure:
                        raise ValueError(
                            "a plain round; this client's fed.secure_aggregation=true sends its "
                            "update masked only"
                        )
                except ValueError as exc:
                    log.warning("round %s: refused the coordinator's task: %s", _round(task), exc)
                    continue
                if message.type == FedMsg.EVALUATE:
                    conn.send_msg(FedMsg.EVAL_RESULT, self.evaluate_global(task, global_state))
                    continue
                if not task.get("secure"):
                    try:
                        result, update = self.train_round(task, global_state)
                    except ValueError as exc:  # training that did not fit this machine
                        log.warning("round %s: %s", _round(task), exc)
                        continue
                    conn.send_msg(FedMsg.RESULT, result)
                    conn.send_tensors(FedMsg.UPDATE, update)
                    self.rounds += 1
                    continue
                try:
                    self.rounds += client_round(
                        conn,
                        client_id=int(welcome["client_id"]),
                        task=task,
                        train=functools.partial(self._train_for_sum, task, global_state),
                        weight=len(self.train_blocks),
                        timeout_s=timeout_s,
                        max_clients=self.max_round_clients,
                        floor=self.floor,
                    )
                except RoundAbandoned as moved:
                    log.warning("round %d: the coordinator moved on", int(task["round"]) + 1)
                    pending = moved.message
                except (ValueError, RoundFailed) as exc:  # Refused is a ValueError
                    log.warning("round %d: left the secure round: %s", int(task["round"]) + 1, exc)
        finally:
            stop.set()

    @property
    def eval_tokens(self) -> int:
        """The tokens an evaluation on the held-out shard predicts (declared at JOIN)."""
        return int(self.val_blocks[:, 1:].numel())

    def evaluate_global(
        self, task: dict[str, Any], global_state: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        """EVAL_RESULT for an EVALUATE: the global adapter's loss on this client's held-out
        shard (null if not finite: JSON has no NaN, and the coordinator refuses it)."""
        load_adapter_state(self.model, global_state)  # only B, after the first round of ffa
        loss = evaluate(self.model, self.val_blocks)
        log.info("round %d: the global adapter's loss here %.4f", int(task["round"]) + 1, loss)
        return {
            "task": task.get("task"),
            "round": task.get("round"),
            "loss": loss if math.isfinite(loss) else None,
            "tokens": self.eval_tokens,
        }

    def _train_local(self, task: dict[str, Any]) -> float:
        return train_local(
            self.model,
            self.train_blocks,
            epochs=int(task["local_epochs"]),
            max_steps=int(task["local_steps"]),
            batch_size=int(task["batch_size"]),
            lr=float(task["lr"]),
            seed=self.seed + int(task["round"]),
            prox_mu=float(task.get("prox_mu", 0.0)),
            freeze_a=bool(task.get("freeze_a", False)),
        )

    def train_round(
        self, task: dict[str, Any], global_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Local training from the global adapter: (result metadata, the new adapter, or only
        its trained tensors when A is frozen: FFA-LoRA's B)."""
        load_adapter_state(self.model, global_state)  # only B, after the first round of ffa
        global_state = adapter_state(self.model)  # the whole global adapter, as now held
        started = time.perf_counter()
        try:  # what a TASK asks within its ranges can still be more than this machine holds
            train_loss = self._train_local(task)
        except (RuntimeError, MemoryError) as exc:  # out of memory, CUDA's included
            raise ValueError(f"local training failed: {str(exc)[:200]}") from exc
        log.info("round %d: train loss %.4f", task["round"] + 1, train_loss)
        result = {
            "task": task.get("task"),  # the RESULT answers this task (see fed_learn.protocol)
            "round": task["round"],
            "num_examples": len(self.train_blocks),
            "train_loss": train_loss,
            "val_loss": evaluate(self.model, self.val_blocks),
            "seconds": time.perf_counter() - started,
        }
        local = adapter_state(self.model)
        if bool(task.get("freeze_a", False)):  # A did not move: the coordinator has it
            frozen = {a_key for a_key, _ in lora_modules(local).values()}
            local = {name: t for name, t in local.items() if name not in frozen}
        method = str(task.get("compression", "none"))
        if method == "none":
            return result, local
        delta = {name: local[name].float() - global_state[name].float() for name in local}
        return result, self.feedback.compress(
            delta, method=method, fraction=float(task["topk_fraction"])
        )

    def _train_for_sum(
        self, task: dict[str, Any], global_state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A secure round's training: (RESULT payload, trained tensors, the global tensors
        they started from), names sorted as the coordinator sums them."""
        load_adapter_state(self.model, global_state)
        start = adapter_state(self.model)  # the whole global adapter, as now held
        result, local = self.train_round(task, global_state)
        names = sorted(local)
        return result, {n: local[n] for n in names}, {n: start[n] for n in names}

    @staticmethod
    def _heartbeat(conn: Connection, every_s: float, stop: threading.Event) -> None:
        """A PING once this client has sent nothing for `every_s`: any frame proves it alive,
        so the coordinator still hears from it at least every `every_s` (training included),
        without a frame (and a PONG back) a beat while it answers a round."""
        wait = every_s
        while not stop.wait(wait):
            wait = conn.last_sent + every_s - time.monotonic()
            if wait > 0:  # it sent something meanwhile: due that long after it
                continue
            try:
                conn.send(MsgType.PING)
            except NetprotoError:
                return
            wait = every_s
