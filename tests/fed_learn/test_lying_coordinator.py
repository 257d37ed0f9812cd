"""A coordinator that lies to its clients (a compromised one, or a stranger who holds the
federation's secret): a secure round weaker than the client's own config (a threshold down to
1, fewer neighbours, no DP noise, a wider clip), a plain round to a client configured for
secure aggregation, a global adapter of the wrong shape. Each costs the client that round, in
one line naming what it refused, not its process; each beside its control arm (the check taken
out), so a test passes only if the attack is real and that check is what stops it."""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fed_learn import client as client_module
from fed_learn import lora
from fed_learn.client import LoRAClient, round_floor
from fed_learn.config import DPConfig, FedConfig, SecAggConfig
from fed_learn.lora import adapter_state, check_adapter_state, peft_model
from fed_learn.privacy import noise_std
from fed_learn.protocol import FedMsg
from fed_learn.secagg_params import Params, RoundFloor
from lab.cluster import connect, serve
from lab.config import Endpoint
from labtools.attacks.join_loop import MODEL, settings
from netproto import Connection

from .test_secure_client_limits import _plain_task

CLIP, CAP, SIGMA = 1.0, 10, 1.0
FED = FedConfig(
    num_clients=5,
    min_fit_clients=4,
    secure_aggregation=True,
    secagg=SecAggConfig(threshold=0.5, neighbors=0),
    dp=DPConfig(enabled=True, clip_norm=CLIP, weight_cap=CAP, noise_multiplier=SIGMA),
)
"""The victim's config: rounds of at least 4 clients, secure aggregation, more than half of 5
holders (3), everyone its neighbour, DP noise of 1.0 x clip x cap over any 3 shares."""


def _secure(number: int, **lies: Any) -> dict[str, Any]:
    """A secure TASK of 5 clients (7..11, this client 7) as an honest coordinator of FED sends
    it, with `lies` in its round parameters."""
    params = {
        "noise_std": noise_std(SIGMA, CLIP * CAP, shares=3),
        "round": number - 1,
        "clients": [7, 8, 9, 10, 11],
        "threshold": 3,
        "neighbors": 4,
        "frac_bits": 16,
        "length": 10,
        "graph_seed": base64.b64encode(b"12345678").decode(),
        "weight_cap": CAP,
        "bound": CLIP,
        **lies,
    }
    return {**_plain_task(number, number - 1), "secure": params}


LIES = {
    "threshold_1": (_secure(1, threshold=1), "fed.secagg.threshold=0.5 needs at least 3"),
    "threshold_2": (_secure(1, threshold=2), "fed.secagg.threshold=0.5 needs at least 3"),
    "fewer_neighbours": (
        _secure(1, neighbors=2, threshold=2),
        "fed.secagg.neighbors=0 asks for 4",
    ),
    "no_noise": (_secure(1, noise_std=0.0), "fed.dp settings need at least"),
    "half_the_noise": (
        _secure(1, noise_std=noise_std(SIGMA, CLIP * CAP, shares=3) / 2),
        "fed.dp settings need at least",
    ),
    "wider_clip": (_secure(1, bound=100.0), "fed.dp.clip_norm=1"),
    "higher_cap": (_secure(1, weight_cap=1000), "fed.dp.weight_cap=10"),
    "plain_round": (_plain_task(1, 0), "fed.secure_aggregation=true"),
    "three_clients": (
        _secure(1, clients=[7, 8, 9], neighbors=2, threshold=2),
        "fed.min_fit_clients asks for at least 4",
    ),
}


def _victim(model: Any, **kwargs: Any) -> LoRAClient:
    return LoRAClient(
        model,
        torch.randint(0, 300, (4, 16)),
        torch.randint(0, 300, (2, 16)),
        name="victim",
        **kwargs,
    )


def _play(run: Any, client: LoRAClient, script: Any) -> tuple[int, list[Any]]:
    """`client` against a scripted coordinator (`script(conn, seen)`), then FINISH: (the
    rounds it took part in, what the script saw)."""
    seen: list[Any] = []
    finished = threading.Event()

    def coordinator(conn: Connection) -> None:
        join = conn.recv(expect=FedMsg.JOIN, timeout_s=30)
        conn.send_msg(FedMsg.WELCOME, {"client_id": 7}, request_id=join.request_id)
        script(conn, seen)
        conn.send(FedMsg.FINISH)
        finished.wait(30)

    server = serve(coordinator, run.cluster, Endpoint(), name="liar")
    try:
        with connect(run.cluster, server.address) as conn:
            rounds = client.run(conn, heartbeat_s=5.0, timeout_s=60)
        finished.set()
    finally:
        finished.set()
        server.stop()
    return rounds, seen


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
@pytest.mark.parametrize("lie", LIES.values(), ids=LIES.keys())
def test_a_round_weaker_than_the_clients_config_costs_the_coordinator_that_round(
    tmp_path: Path, lab_cache: Path, monkeypatch, caplog, lie, checked: bool
) -> None:
    """Task 1 is weaker than the victim's config; task 2 is what an honest coordinator of that
    config sends. Checked: the victim refuses task 1 in one line naming the key and sends
    nothing for it: its first answer is task 2's SA_KEYS. Control (the floor taken out): its
    first answer is task 1's (SA_KEYS, or a plain round's RESULT: its update in clear; the
    control's victim has fed.secure_aggregation off)."""
    task, key = lie
    if not checked:
        monkeypatch.setattr(RoundFloor, "check", lambda *a, **k: None)
    run = settings(tmp_path, lab_cache)
    model = peft_model(MODEL, run.lora, cache_dir=lab_cache)
    state = adapter_state(model)

    def script(conn: Connection, seen: list[Any]) -> None:
        for payload in (task, _secure(2)):
            conn.send_msg(FedMsg.TASK, payload)
            conn.send_tensors(FedMsg.GLOBAL, state)
        first = conn.recv(expect={FedMsg.SA_KEYS, FedMsg.RESULT}, timeout_s=60)
        seen.append((FedMsg(first.type).name, first.payload["task"]))

    victim = _victim(model, floor=replace(round_floor(FED), secure=checked))
    with caplog.at_level(logging.WARNING, logger="fed_learn.client"):
        rounds, seen = _play(run, victim, script)
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    left = [r.getMessage() for r in caplog.records if "left the secure round" in r.getMessage()]
    if checked:
        assert seen == [("SA_KEYS", 2)]
        assert len(refused + left) == 1 and key in (refused + left)[0]
    else:
        plain = "secure" not in task
        assert seen == [("RESULT" if plain else "SA_KEYS", 1)]
        assert not refused and not left
    assert rounds == (0 if checked or "secure" in task else 1)


def test_the_floor_takes_what_an_honest_coordinator_of_the_same_config_sends() -> None:
    """The honest round passes (the noise share worked out as the coordinator does), one
    with more shares or more neighbours than asked too; without DP any noise does."""
    floor = round_floor(FED)
    payload = _secure(1)["secure"]
    params = _params(payload)
    floor.check(params, weight_cap=CAP, bound=CLIP, share_std=payload["noise_std"])
    stronger = replace(params, threshold=5)  # every holder: each share's noise is smaller
    floor.check(stronger, weight_cap=3, bound=0.5, share_std=noise_std(SIGMA, CLIP * CAP, shares=5))
    no_dp = round_floor(replace(FED, dp=DPConfig()))
    no_dp.check(params, weight_cap=10**6, bound=1e9, share_std=0.0)
    assert RoundFloor().secure is False and round_floor(FED).secure is True


def _params(payload: dict[str, Any]) -> Params:
    return Params(
        round=payload["round"],
        clients=tuple(payload["clients"]),
        threshold=payload["threshold"],
        neighbors=payload["neighbors"],
        frac_bits=payload["frac_bits"],
        length=payload["length"],
        graph_seed=base64.b64decode(payload["graph_seed"]),
    )


# ------------------------------------------------------------------ the global adapter


def _reshaped(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter with its first tensor one row longer: its names right, a shape wrong."""
    name = sorted(state)[0]
    grown = torch.zeros((state[name].shape[0] + 1, *state[name].shape[1:]))
    return {**state, name: grown}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_wrong_shape_global_adapter_costs_the_round_not_the_process(
    tmp_path: Path, lab_cache: Path, monkeypatch, caplog, checked: bool
) -> None:
    """Task 1 comes with an adapter of the right names and a wrong shape, task 2 with the
    right one. Checked: the victim refuses task 1 in one line giving both shapes and trains
    task 2. Control (the shape check taken out): PEFT's RuntimeError ends the client's run."""
    if not checked:
        monkeypatch.setattr(client_module, "check_adapter_state", lambda *a: None)
        monkeypatch.setattr(lora, "check_adapter_state", lambda *a: None)
    run = settings(tmp_path, lab_cache)
    model = peft_model(MODEL, run.lora, cache_dir=lab_cache)
    state = adapter_state(model)

    def script(conn: Connection, seen: list[Any]) -> None:
        for number, sent in ((1, _reshaped(state)), (2, state)):
            conn.send_msg(FedMsg.TASK, _plain_task(number, number - 1))
            conn.send_tensors(FedMsg.GLOBAL, sent)
        if checked:
            result = conn.recv(expect=FedMsg.RESULT, timeout_s=60)
            seen.append(result.payload["task"])
            conn.recv(expect=FedMsg.UPDATE, timeout_s=60)

    victim = _victim(model)
    with caplog.at_level(logging.WARNING, logger="fed_learn.client"):
        if not checked:
            with pytest.raises(RuntimeError, match="size mismatch"):
                _play(run, victim, script)
            return
        rounds, seen = _play(run, victim, script)
    assert rounds == 1 and seen == [2]
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "round 1: refused the coordinator's task: adapter tensor" in line
    assert "has shape" in line and "this model's is" in line


def test_an_adapter_of_other_names_dtypes_or_no_tensors_is_refused_in_one_line(
    lab_cache: Path, tmp_path: Path
) -> None:
    run = settings(tmp_path, lab_cache)
    model = peft_model(MODEL, run.lora, cache_dir=lab_cache)
    state = adapter_state(model)
    name = sorted(state)[0]
    check_adapter_state(model, state)
    check_adapter_state(model, {name: state[name].double()})  # a subset, another precision
    bad = {
        "unknown name": {**state, "base_model.evil": torch.zeros(1)},
        "integer dtype": {**state, name: state[name].to(torch.int64)},
        "complex dtype": {**state, name: state[name].to(torch.complex64)},
        "float8 dtype": {**state, name: state[name].to(torch.float8_e4m3fn)},
        "packed float4 dtype": {
            **state,
            name: torch.zeros(state[name].shape, dtype=torch.float4_e2m1fn_x2),
        },
        "not a tensor": {**state, name: [0.0]},
        "empty": {},
        "not a dict": [state[name]],
    }
    for why, sent in bad.items():
        with pytest.raises(ValueError, match="adapter tensor") as refused:
            check_adapter_state(model, sent)
        assert "\n" not in str(refused.value), why


def test_a_real_secure_dp_run_passes_every_clients_floor(
    compose_config, tiny_models: Path, caplog
) -> None:
    """An honest coordinator and its clients of one config (3 simulated, secure aggregation,
    DP whose noise multiplier both work out from fed.dp.target_epsilon, a sparse graph): every
    round is taken by every client (none refuses its parameters) and nothing is refused."""
    from fed_learn.run import run

    from .test_secure_rounds import REAL

    overrides = [
        *REAL,
        "fed.rounds=2",
        "fed.secure_aggregation=true",
        "fed.secagg.neighbors=1",
        "fed.secagg.threshold=0.6",
        "fed.dp.enabled=true",
        "fed.dp.target_epsilon=50",
        "fed.dp.weight_cap=8",
    ]
    with caplog.at_level(logging.WARNING, logger="fed_learn.client"):
        metrics = run(compose_config("fed_learn", overrides))
    assert metrics["mean_clients_per_round"] == 3 and metrics["refused"] == 0
    assert not [r for r in caplog.records if r.name == "fed_learn.client"]


MALFORMED_TASKS = {  # case: (the TASK, the field its refusal names)
    "task id a float": ({**_plain_task(1, 0), "task": 1.5}, "task"),
    "no round": ({k: v for k, v in _plain_task(1, 0).items() if k != "round"}, "round"),
    "no local_epochs": (
        {k: v for k, v in _plain_task(1, 0).items() if k != "local_epochs"},
        "local_epochs",
    ),
    "round a string": ({**_plain_task(1, 0), "round": "0"}, "round"),
    "round past 32 bits": ({**_plain_task(1, 0), "round": 2**40}, "round"),
    "a billion steps": ({**_plain_task(1, 0), "local_steps": 10**9}, "local_steps"),
    "batch of zero": ({**_plain_task(1, 0), "batch_size": 0}, "batch_size"),
    "lr not a number": ({**_plain_task(1, 0), "lr": "fast"}, "lr"),
    "unknown compression": ({**_plain_task(1, 0), "compression": "zip"}, "compression"),
    "freeze_a a string": ({**_plain_task(1, 0), "freeze_a": "yes"}, "freeze_a"),
    "compression in a secure round": (
        {**_secure(1), "compression": "topk"},
        "compression in a secure round",
    ),
}


def _tasks_then_one_answer(
    tasks: list[dict[str, Any]], state: dict[str, torch.Tensor]
) -> Callable[[Connection, list[Any]], None]:
    """A scripted coordinator (for `_play`): each TASK with `state` as its GLOBAL, then the one
    RESULT + UPDATE it expects back, the answered task's number into `seen`."""

    def script(conn: Connection, seen: list[Any]) -> None:
        for payload in tasks:
            conn.send_msg(FedMsg.TASK, payload)
            conn.send_tensors(FedMsg.GLOBAL, state)
        result = conn.recv(expect=FedMsg.RESULT, timeout_s=60)
        seen.append(result.payload["task"])
        conn.recv(expect=FedMsg.UPDATE, timeout_s=60)

    return script


def test_a_malformed_task_costs_the_coordinator_that_round_not_the_client(
    tmp_path: Path, lab_cache: Path, caplog
) -> None:
    """Each malformed task (a field missing, of the wrong type or out of range: a lying
    coordinator asking for a billion steps included) then an honest one: the client refuses
    each in one line naming the field and trains the last. Before, a missing field raised
    KeyError out of the client. (A payload that is not a JSON object netproto refuses itself.)"""
    run = settings(tmp_path, lab_cache)
    model = peft_model(MODEL, run.lora, cache_dir=lab_cache)
    state = adapter_state(model)
    honest = len(MALFORMED_TASKS) + 1
    tasks = [task for task, _ in MALFORMED_TASKS.values()]
    script = _tasks_then_one_answer([*tasks, _plain_task(honest, 1)], state)
    with caplog.at_level(logging.WARNING, logger="fed_learn.client"):
        rounds, seen = _play(run, _victim(model), script)
    assert rounds == 1 and seen == [honest]
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == len(MALFORMED_TASKS), refused
    named = [field for _, field in MALFORMED_TASKS.values()]
    for line, field in zip(refused, named, strict=True):
        assert "refused the coordinator's task: TASK" in line and field in line, line


def test_training_that_runs_out_of_memory_costs_that_round_not_the_client(
    tmp_path: Path, lab_cache: Path, monkeypatch, caplog
) -> None:
    """A task within every range can still ask more than the machine holds (a batch of the
    whole shard on a big vocabulary): torch's out-of-memory RuntimeError in the first task's
    training (injected: this box has the memory) costs that round, one line, and the client
    trains the next. Before, it ended the client's process."""
    run = settings(tmp_path, lab_cache)
    model = peft_model(MODEL, run.lora, cache_dir=lab_cache)
    state = adapter_state(model)
    real, calls = client_module.train_local, []

    def train_local(*args: Any, **kwargs: Any) -> float:
        calls.append(kwargs["batch_size"])
        if len(calls) == 1:
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory"
            )
        return real(*args, **kwargs)

    monkeypatch.setattr(client_module, "train_local", train_local)
    script = _tasks_then_one_answer([_plain_task(n, n - 1) for n in (1, 2)], state)
    with caplog.at_level(logging.WARNING, logger="fed_learn.client"):
        rounds, seen = _play(run, _victim(model), script)
    assert rounds == 1 and seen == [2] and len(calls) == 2
    [line] = [r.getMessage() for r in caplog.records if "training failed" in r.getMessage()]
    assert line.startswith("round 1: local training failed: [enforce fail") and "memory" in line
