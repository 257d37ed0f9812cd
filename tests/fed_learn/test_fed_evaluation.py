"""Federated evaluation and server optimizers on a live coordinator: scripted clients over real
netproto connections (test_adversarial's federation), and real local runs."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from fed_learn.config import SecAggConfig
from fed_learn.evaluation import summarize
from fed_learn.protocol import Evaluation, FedMsg, parse_evaluation, parse_join
from fed_learn.run import run
from lab.tracking import METRICS_FILE, read_records
from labtools.attacks.secure_rounds import SecurePlayer, offset_delta, result_for
from netproto import Connection, NetprotoError
from tests.clocks import HANG_GUARD_S

from .test_adversarial import (  # noqa: F401 (federation: the fixture, used by name)
    Federation,
    federation,
)

EvalAnswer = Callable[[dict[str, Any]], dict[str, Any]]


def evaluation(loss: Any, tokens: Any) -> EvalAnswer:
    return lambda task: {**result_for(task), "loss": loss, "tokens": tokens}


@dataclass
class EvalPlayer:
    """Trains as test_adversarial's honest clients do (the global adapter plus `offset`) and
    answers every EVALUATE with `answer(task)`, having declared `eval_tokens` at JOIN."""

    offset: float
    answer: EvalAnswer
    eval_tokens: int = 100
    name: str = "player"
    evaluations: int = 0
    errors: list[BaseException] = field(default_factory=list)

    def play(self, conn: Connection) -> None:
        try:
            conn.request(
                FedMsg.JOIN,
                {"name": self.name, "num_examples": 10, "eval_tokens": self.eval_tokens},
                expect=FedMsg.WELCOME,
            )
            while True:
                message = conn.recv(expect={FedMsg.TASK, FedMsg.FINISH, FedMsg.EVALUATE})
                if message.type == FedMsg.FINISH:
                    return
                global_state = conn.recv_tensors(FedMsg.GLOBAL)
                task = message.payload
                if message.type == FedMsg.EVALUATE:
                    self.evaluations += 1
                    conn.send_msg(FedMsg.EVAL_RESULT, self.answer(task))
                    continue
                delta = offset_delta(global_state, self.offset)
                conn.send_msg(FedMsg.RESULT, result_for(task))
                conn.send_tensors(FedMsg.UPDATE, {n: global_state[n] + delta[n] for n in delta})
        except NetprotoError as exc:
            self.errors.append(exc)
        finally:
            conn.close()


# ---------------------------------------------------------------- checks on what clients send


def test_summary_is_the_token_weighted_mean_with_the_spread_over_clients() -> None:
    got = summarize([(3, Evaluation(1, 0, 2.0, 100)), (7, Evaluation(2, 0, 3.0, 300))])
    assert got["client_eval_loss"] == pytest.approx((2.0 * 100 + 3.0 * 300) / 400)
    assert got["client_eval_loss_std"] == pytest.approx(0.5)
    assert (got["client_eval_loss_min"], got["client_eval_loss_max"]) == (2.0, 3.0)
    assert (got["client_eval_loss/3"], got["client_eval_loss/7"]) == (2.0, 3.0)
    assert got["client_eval_clients"] == 2 and got["client_eval_tokens"] == 400


BAD_EVALUATIONS = {
    "loss_negative": ({"loss": -0.5}, "loss"),
    "loss_not_finite": ({"loss": float("nan")}, "loss"),
    "loss_infinite": ({"loss": float("inf")}, "loss"),
    "loss_null": ({"loss": None}, "loss"),
    "loss_string": ({"loss": "2.0"}, "loss"),
    "tokens_beyond_declared": ({"tokens": 101}, "tokens"),
    "tokens_zero": ({"tokens": 0}, "tokens"),
    "tokens_float": ({"tokens": 50.0}, "tokens"),
    "tokens_bool": ({"tokens": True}, "tokens"),
    "round_of_another_round": ({"round": 1}, "round"),
}


@pytest.mark.parametrize("fields,key", BAD_EVALUATIONS.values(), ids=BAD_EVALUATIONS.keys())
def test_a_bad_evaluation_is_refused_naming_its_field(fields: dict, key: str) -> None:
    payload = {"task": 5, "round": 0, "loss": 2.0, "tokens": 100, **fields}
    with pytest.raises(ValueError, match=f"EVAL_RESULT's {key}="):
        parse_evaluation(payload, task=5, round_index=0, declared_tokens=100)
    missing = {k: v for k, v in payload.items() if k != key}
    with pytest.raises(ValueError, match=f"EVAL_RESULT has no {key}"):
        parse_evaluation(missing, task=5, round_index=0, declared_tokens=100)


@pytest.mark.parametrize("eval_tokens", [-1, 2**40 + 1, 1.5, "100"])
def test_a_join_declaring_impossible_held_out_tokens_is_refused(eval_tokens: Any) -> None:
    with pytest.raises(ValueError, match="eval_tokens"):
        parse_join({"name": "a", "num_examples": 3, "eval_tokens": eval_tokens})
    assert parse_join({"name": "a", "num_examples": 3}).eval_tokens == 0  # none declared


# ---------------------------------------------------------------- a live coordinator


@pytest.mark.parametrize(
    "rogue",
    [evaluation(-1.0, 50), evaluation(None, 50), evaluation(2.5, 101)],
    ids=["negative_loss", "non_finite_loss_as_null", "tokens_beyond_declared"],
)
def test_a_bad_evaluation_is_left_out_of_the_rounds_mean_and_named(
    federation,  # noqa: F811 (the imported fixture)
    rogue: EvalAnswer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    players = [
        EvalPlayer(0.01, evaluation(2.0, 100), name="honest1"),
        EvalPlayer(0.02, evaluation(3.0, 300), eval_tokens=300, name="honest2"),
        EvalPlayer(0.03, rogue, name="rogue"),
    ]
    fed = federation(players, evaluate_on_clients=True, rounds=2, eval_every=2)
    ids = {p.name: fed.client(p.name).client_id for p in players}
    with caplog.at_level(logging.WARNING, logger="fed_learn.evaluation"):
        _, rounds = fed.run()
    assert "client_eval_loss" not in rounds[0]  # eval_every=2: round 2 only
    record = rounds[1]
    assert record["client_eval_loss"] == pytest.approx(2.75)
    assert (record["client_eval_clients"], record["client_eval_refused"]) == (2, 1)
    assert f"client_eval_loss/{ids['rogue']}" not in record
    assert record[f"client_eval_loss/{ids['honest2']}"] == 3.0
    [refusal] = [r.getMessage() for r in caplog.records if "evaluation" in r.getMessage()]
    assert f"client {ids['rogue']} (rogue)" in refusal and "EVAL_RESULT's" in refusal
    assert [p.evaluations for p in players] == [1, 1, 1]
    assert not any(p.errors for p in players)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
def test_fedadam_steps_each_coordinate_by_server_lr_from_the_rounds_mean(
    federation,  # noqa: F811 (the imported fixture)
    secure: bool,
) -> None:
    """With tau far below the updates, FedAdam's first step moves every entry by server_lr in
    the direction of the mean update (+0.02 here), whatever its size: in a plain round and on
    secure aggregation's unmasked sum."""
    options: dict[str, Any] = {"server_optimizer": "adam", "server_lr": 0.005}
    options["server_tau"] = 1e-9
    if secure:
        players: list[Any] = [SecurePlayer(0.01, 10), SecurePlayer(0.03, 10)]
        # every client answers: steps wait to the hang guard, not a time an honest one must beat
        options |= {"secure_aggregation": True, "secagg": SecAggConfig(step_timeout_s=HANG_GUARD_S)}
    else:
        players = [EvalPlayer(0.01, evaluation(1.0, 1)), EvalPlayer(0.03, evaluation(1.0, 1))]
    fed = federation(players, **options)
    fed.run()
    got = fed.final()
    for name, before in fed.initial.items():
        torch.testing.assert_close(got[name], before + 0.005, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- real local runs

QUICK = [
    "model.lab_preset=debug",
    "tracking.wandb=false",
    "fed.num_clients=2",
    "fed.local_steps=5",
    "fed.lr=0.01",
    "fed.max_examples_per_client=64",
    "fed.eval_blocks=8",
    "fed.centralized_baseline=false",
    "fed.server_optimizer=adam",
    "fed.server_lr=0.01",
]


def round_losses(run_dir: Path) -> list[float]:
    records = read_records(run_dir / "coordinator" / METRICS_FILE)
    return [r["val_loss"] for r in records if "clients" in r]


@pytest.mark.slow  # five local runs
def test_a_resumed_fedadam_run_repeats_the_uninterrupted_one(
    compose_config, tiny_models: Path, tmp_path: Path
) -> None:
    """4 rounds straight vs 2 rounds then fed.resume=true to 4: the same losses to 1e-6, the
    server optimizer's moments coming back from the checkpoint; without them (the control:
    the file removed, so Adam starts afresh) round 3 differs."""
    straight_dir = f"paths.run_dir={tmp_path / 'straight'}"
    straight = run(compose_config("fed_learn", [*QUICK, "fed.rounds=4", straight_dir]))
    parts = [*QUICK, f"paths.run_dir={tmp_path / 'resumed'}"]
    run(compose_config("fed_learn", [*parts, "fed.rounds=2"]))
    checkpoints = tmp_path / "resumed" / "coordinator" / "checkpoints"
    state = json.loads((checkpoints / "round_0002" / "fed_state.json").read_text())
    assert state["server_optimizer"]["name"] == "adam" and state["server_optimizer"]["step"] == 2
    resumed = run(compose_config("fed_learn", [*parts, "fed.rounds=4", "fed.resume=true"]))
    expected = round_losses(tmp_path / "straight")
    got = round_losses(tmp_path / "resumed")
    assert len(expected) == len(got) == 4
    assert got == pytest.approx(expected, abs=1e-6, rel=0)
    assert resumed["final_val_loss"] == pytest.approx(straight["final_val_loss"], abs=1e-6)

    control = tmp_path / "control"
    run(compose_config("fed_learn", [*QUICK, "fed.rounds=2", f"paths.run_dir={control}"]))
    (
        control / "coordinator" / "checkpoints" / "round_0002" / "server_optimizer.safetensors"
    ).unlink()
    again = [*QUICK, "fed.rounds=3", "fed.resume=true", f"paths.run_dir={control}"]
    run(compose_config("fed_learn", again))
    assert abs(round_losses(control)[2] - expected[2]) > 1e-6


# federated evaluation in a real run: tests/fed_learn/test_federation.py (on its two-client run)


def test_file_type_partition_gives_each_client_one_kind_of_file() -> None:
    """fed.partition=file_type: 3 clients hold .py, .decTest and the other text files; 6
    clients split each type in two disjoint halves; the coordinator's held-out files stay out."""
    from fed_learn.partition import FILE_TYPES, file_type_shard, text_files
    from lab.corpus import load_finetune_corpus

    try:
        files = text_files()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    kind_of = {text: kind for kind, found in files.items() for _, text in found}
    everything = 10**12
    for index, kind in enumerate(FILE_TYPES):
        shard = file_type_shard(index, 3, seed=0, max_chars=everything)
        assert shard and {kind_of[text] for text in shard} == {kind}
    first, second = (file_type_shard(i, 6, seed=0, max_chars=everything) for i in (1, 4))
    assert not set(first) & set(second)
    assert sorted(first + second) == sorted(text for _, text in files["decTest"])
    held_out = {d.path for d in load_finetune_corpus().validation}
    assert held_out and not held_out & {path for found in files.values() for path, _ in found}
    capped = file_type_shard(0, 3, seed=0, max_chars=5000)
    assert sum(map(len, capped)) == 5000
