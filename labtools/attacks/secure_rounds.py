"""A secret holder inside a secure federation (fed_learn.secure), issue 48's scripted attacks:
scripted clients that run the real client side of the protocol, one of them tampering with one
message (an offset of 2^58 on its masked input, a replay of an earlier one, a weight of 2^40,
a wrong share index in one neighbour's box).

The honest clients answer with the global adapter plus a fixed offset, so the unmasked sum is
known exactly. tests/fed_learn (test_secure_rounds, test_secure_attacks) and
bench/abuse_bench.py play the same clients from here."""

from __future__ import annotations

import logging
import math
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from fed_learn import secagg, secure
from fed_learn.config import FedConfig, FedLearnRunConfig, SecAggConfig
from fed_learn.coordinator import Coordinator
from fed_learn.lora import adapter_state, peft_model
from fed_learn.protocol import FedMsg
from fed_learn.secagg_params import RoundFloor
from lab.cluster import connect, serve
from lab.config import Endpoint, ModelConfig, PathsConfig, TrackingConfig
from lab.tracking import METRICS_FILE, Tracker, read_records
from netproto import Connection, NetprotoError

MODEL = ModelConfig(pretrained="lab:tiny_target", lab_preset="debug")
State = dict[str, torch.Tensor]
Step = Callable[[Connection, dict[str, Any], State, "SecurePlayer"], None]
HONEST = (0.01, 0.02)
"""The honest clients' offsets (weight 10 each) beside one attacker (weight 10 too)."""


def result_for(task: dict[str, Any], *, num_examples: int = 10, **fields: Any) -> dict[str, Any]:
    """A well-formed RESULT for `task`, with `fields` changed."""
    return {
        "task": task["task"],
        "round": task["round"],
        "num_examples": num_examples,
        "train_loss": 1.0,
        "val_loss": 1.0,
        "seconds": 0.1,
        **fields,
    }


def offset_delta(global_state: State, offset: float, *, keys: str = "") -> State:
    """`offset` on every entry of the tensors whose name contains `keys` (all by default)."""
    return {
        name: torch.full_like(t, offset) if keys in name else torch.zeros_like(t)
        for name, t in global_state.items()
    }


def honest_train(task: dict[str, Any], global_state: State, offset: float, examples: int):
    names = sorted(global_state)
    delta = offset_delta(global_state, offset)
    local = {n: global_state[n] + delta[n] for n in names}
    return result_for(task, num_examples=examples), local, {n: global_state[n] for n in names}


@dataclass
class SecurePlayer:
    """A scripted client: joins, then runs `step` on each task (default: the honest
    protocol with its update = global + `offset`)."""

    offset: float = 0.01
    examples: int = 10
    step: Step | None = None
    name: str = "honest"
    client_id: int = -1
    join_delay_s: float = 0.0
    floor: RoundFloor = field(default_factory=RoundFloor)
    """The weakest round it takes part in (the defaults: the least any config allows)."""
    errors: list[BaseException] = field(default_factory=list)

    def play(self, conn: Connection) -> None:
        try:
            time.sleep(self.join_delay_s)
            welcome = conn.request(
                FedMsg.JOIN,
                {"name": self.name, "num_examples": self.examples},
                expect=FedMsg.WELCOME,
            ).payload
            self.client_id = welcome["client_id"]
            pending = None
            while True:
                message = pending or conn.recv(expect={FedMsg.TASK, FedMsg.FINISH})
                pending = None
                if message.type == FedMsg.FINISH:
                    return
                global_state = conn.recv_tensors(FedMsg.GLOBAL)
                try:
                    (self.step or honest)(conn, message.payload, global_state, self)
                except secure.RoundAbandoned as moved:
                    pending = moved.message
                except (ValueError, secagg.RoundFailed) as exc:
                    self.errors.append(exc)
        except NetprotoError as exc:
            self.errors.append(exc)
        finally:
            conn.close()


def honest(conn: Connection, task: dict[str, Any], state: State, me: SecurePlayer) -> None:
    secure.client_round(
        conn,
        client_id=me.client_id,
        task=task,
        train=lambda: honest_train(task, state, me.offset, me.examples),
        weight=me.examples,
        timeout_s=30,
        max_clients=SecAggConfig.max_clients,
        floor=me.floor,
    )


def tampered(
    *,
    result: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None,
    masked: Callable[[dict[str, Any], np.ndarray], np.ndarray] | None = None,
) -> Step:
    """The honest protocol (update = global + 0.03), its RESULT and masked input rewritten on
    the way out by `result(task, payload)` and `masked(task, uint64 array)`."""

    def step(conn: Connection, task: dict[str, Any], state: State, me: SecurePlayer) -> None:
        send_msg, send_tensors = conn.send_msg, conn.send_tensors

        def msg(kind: int, payload: Any, **kw: Any) -> Any:
            if kind == FedMsg.RESULT and result is not None:
                payload = result(task, payload)
            return send_msg(kind, payload, **kw)

        def tensors(kind: int, payload: Any, **kw: Any) -> Any:
            if kind == FedMsg.SA_MASKED and masked is not None:
                payload = {"masked": torch.from_numpy(masked(task, payload["masked"].numpy()))}
            return send_tensors(kind, payload, **kw)

        conn.send_msg, conn.send_tensors = msg, tensors  # type: ignore[method-assign,assignment]
        try:
            honest(conn, task, state, me)
        finally:
            conn.send_msg, conn.send_tensors = send_msg, send_tensors  # type: ignore[method-assign]

    return step


def players_with(step: Step) -> list[SecurePlayer]:
    """The two honest clients and the attacker (it joins last: the highest id)."""
    return [
        *(SecurePlayer(o, 10) for o in HONEST),
        SecurePlayer(0.03, 10, step=step, name="attacker", join_delay_s=0.3),
    ]


def offset_masked(task: dict[str, Any], masked: np.ndarray) -> np.ndarray:
    """2^58 on every update entry of a masked input; the weight entry left alone."""
    out = masked.copy()
    out[:-1] += np.uint64(2**58)
    return out


def replay() -> Step:
    """Honest in round 1 (its masked input kept), round 1's masked input again in round 2."""
    kept: list[np.ndarray] = []

    def masked(task: dict[str, Any], array: np.ndarray) -> np.ndarray:
        if not kept:
            kept.append(array.copy())
            return array
        return kept[0]

    return tampered(masked=masked)


def heavy_result(task: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    """A weight of 2^40 in clear, over the 10 declared at JOIN."""
    return {**payload, "weight": 2**40}


def heavy_masked(task: dict[str, Any], masked: np.ndarray) -> np.ndarray:
    out = masked.copy()
    out[-1] += np.uint64(2**40 - 10)  # the masked weight entry: 10 becomes 2^40
    return out


def reindexed_box(dealer: secagg.Client, recipient: int, box: bytes, index: int) -> bytes:
    """`dealer`'s share box for `recipient` with another Shamir index written in it, sealed
    again with the dealer's own keys: a box its recipient opens, its index wrong."""
    shared = secagg._agree(dealer._c, dealer._keys[recipient][0], recipient)
    aead = ChaCha20Poly1305(secagg._box_key(shared, dealer.params, dealer.client_id, recipient))
    plain = bytearray(aead.decrypt(bytes(12), box, None))
    struct.pack_into("<H", plain, secagg._SHARES.size - 2, index)  # the header's last field
    return aead.encrypt(bytes(12), bytes(plain), None)


def moved(coordinator: Coordinator, initial: State) -> float:
    """The L2 distance the global adapter moved from `initial`."""
    got = adapter_state(coordinator.model)
    return float(
        torch.cat([(got[n].double() - initial[n].double()).reshape(-1) for n in initial]).norm()
    )


def secure_settings(run_dir: Path, cache_dir: Path, players: int, **fed: Any) -> FedLearnRunConfig:
    """A secure federation of `players` scripted clients, 2 s secure-aggregation steps."""
    base = FedConfig(
        rounds=1,
        num_clients=players,
        min_fit_clients=2,
        round_timeout_s=30,
        wait_clients_s=10,
        max_examples_per_client=32,
        eval_blocks=4,
        heartbeat_s=0.5,
        heartbeat_timeout_s=20,
        secure_aggregation=True,
        secagg=SecAggConfig(step_timeout_s=2.0),
    )
    return FedLearnRunConfig(
        model=MODEL,
        fed=replace(base, **fed),
        paths=PathsConfig(run_dir=str(run_dir), cache_dir=str(cache_dir)),
        tracking=TrackingConfig(wandb=False, console=False),
    )


def run_secure(
    players: list[SecurePlayer], *, cache_dir: Path, **fed: Any
) -> tuple[Coordinator, State, list[dict[str, Any]]]:
    """A live coordinator (in this process) and `players` in threads, every round run:
    (coordinator, the adapter before, each round's metrics record)."""
    run_dir = Path(tempfile.mkdtemp(prefix="secagg-attack-"))
    settings = secure_settings(run_dir, cache_dir, len(players), **fed)
    model = peft_model(MODEL, settings.lora, cache_dir=cache_dir)
    coordinator = Coordinator(settings, model, torch.randint(0, 300, (4, 32)))
    initial = adapter_state(model)
    server = serve(coordinator.handle, settings.cluster, Endpoint(), name="coordinator")
    threads = []
    try:
        for player in players:
            conn = connect(settings.cluster, server.address)
            threads.append(threading.Thread(target=player.play, args=(conn,), daemon=True))
            threads[-1].start()
        coordinator.wait_for_clients(len(players))
        with Tracker(run_dir, config={}, tracking=settings.tracking, job="attack") as tracker:
            coordinator.run_rounds(tracker)
    finally:
        server.stop()
        for thread in threads:
            thread.join(timeout=10)
    rounds = [r for r in read_records(run_dir / METRICS_FILE) if "clients" in r]
    return coordinator, initial, rounds


@dataclass
class SecaggAttack:
    """One attack's outcome: refused as the issue asks, the adapter's move against its bound."""

    refused: bool
    how: str
    moved: float
    bound: float
    finite: bool
    honest_errors: int


def secagg_attacks(cache_dir: Path) -> dict[str, SecaggAttack]:
    """The offset (one round), the replay and the weight (two rounds each), one attacker beside
    two honest clients. Refused: the offset's round whole, with no one named (not attributable);
    the replay and the weight by the attacker's name, excluded from later rounds."""
    logging.getLogger("fed_learn").setLevel(logging.ERROR)  # each refusal logs a warning
    attacks: dict[str, tuple[Step, int]] = {
        "offset 2^58 on a masked input": (tampered(masked=offset_masked), 1),
        "replayed masked input": (replay(), 2),
        "weight 2^40": (tampered(result=heavy_result, masked=heavy_masked), 2),
    }
    outcomes = {}
    for name, (step, rounds) in attacks.items():
        players = players_with(step)
        coordinator, initial, records = run_secure(players, cache_dir=cache_dir, rounds=rounds)
        attacker = players[-1].client_id
        distance = moved(coordinator, initial)
        if name.startswith("offset"):
            refused = distance == 0.0 and records[0]["refused"] == 0 and not coordinator.excluded
            how = "round refused whole, adapter kept" if refused else "taken"
        else:
            refused = coordinator.excluded == {attacker}
            how = f"client {attacker} named and excluded" if refused else "no one named"
        finite = all(
            bool(torch.isfinite(t).all()) for t in adapter_state(coordinator.model).values()
        )
        finite = finite and all(math.isfinite(r["val_loss"]) for r in records)
        outcomes[name] = SecaggAttack(
            refused,
            how,
            distance,
            coordinator.fed.max_update_norm,
            finite,
            sum(len(p.errors) for p in players[:-1]),
        )
    return outcomes
