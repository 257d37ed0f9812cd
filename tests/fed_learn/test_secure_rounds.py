"""Secure aggregation over the wire (fed_learn.secure): a live coordinator and scripted clients
that run the real client side of the protocol, some of them rogue or dropping out at a step.

The honest clients answer with the global adapter plus a fixed offset, so the unmasked sum is
known exactly; every test checks the round's outcome against it."""

from __future__ import annotations

import base64
import itertools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fed_learn.admission import NotEnoughClientsError
from fed_learn.config import DPConfig, FedConfig, SecAggConfig
from fed_learn.coordinator import Coordinator
from fed_learn.lora import adapter_state
from fed_learn.privacy import Accountant
from fed_learn.protocol import FedMsg
from fed_learn.run import run
from fed_learn.secure import SecureRound
from fed_learn.secure_inbox import SecureInbox
from labtools.attacks.secure_rounds import (
    SecurePlayer,
    State,
    Step,
    honest,
    honest_train,
    offset_delta,
)
from netproto import Connection
from tests.clocks import HANG_GUARD_S

from .test_adversarial import (  # noqa: F401 (federation: the fixture, used by name)
    Federation,
    federation,
)


@pytest.fixture
def secure_federation(
    federation: Callable[..., Federation],  # noqa: F811 (the imported fixture)
) -> Callable[..., tuple[Coordinator, State, list[dict[str, Any]]]]:
    """test_adversarial's live coordinator (its teardown checks no scripted client hung), with
    secure aggregation on: one round run; (coordinator, adapter before, the rounds' metrics).
    Its steps wait up to the hang guard: a step ends when every client answered or left, and
    a short timeout could lapse on an honest client of a busy machine (a test whose clients
    stay silent sets its own)."""

    def start(players: list[SecurePlayer], **fed: Any):
        fed.setdefault("secure_aggregation", True)
        fed.setdefault("secagg", SecAggConfig(step_timeout_s=HANG_GUARD_S))
        live = federation(players, **fed)
        _, rounds = live.run()
        return live.coordinator, live.initial, rounds

    return start


def in_join_order(players: list[SecurePlayer]) -> list[SecurePlayer]:
    """Each player sends JOIN once the one before it was welcomed (its client id taken): the
    ids follow the list, waited on, not a `join_delay_s` a busy machine may outlast."""
    for before, player in itertools.pairwise(players):

        def play(conn: Connection, before=before, play=player.play) -> None:
            deadline = time.monotonic() + HANG_GUARD_S
            while before.client_id < 0 and not before.errors and time.monotonic() < deadline:
                time.sleep(0.01)
            play(conn)

        player.join_delay_s = 0.0
        player.play = play  # type: ignore[method-assign]
    return players


def expected_mean(initial: State, offsets: list[float], weights: list[int]) -> State:
    mean = sum(o * w for o, w in zip(offsets, weights, strict=True)) / sum(weights)
    delta = offset_delta(initial, mean)
    return {n: initial[n] + delta[n] for n in initial}


def assert_adapter(coordinator: Coordinator, expected: State) -> None:
    got = adapter_state(coordinator.model)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)


def test_the_secure_round_gives_the_weighted_mean(secure_federation) -> None:
    players = [SecurePlayer(0.01, 10), SecurePlayer(0.03, 20), SecurePlayer(-0.02, 5)]
    coordinator, initial, rounds = secure_federation(players)
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.03, -0.02], [10, 20, 5]))
    assert rounds[0]["clients"] == 3 and rounds[0]["refused"] == 0
    assert all(not p.errors for p in players)


def test_sparse_neighbourhoods_give_the_same_mean(secure_federation) -> None:
    offsets = [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]
    players = [SecurePlayer(o, 10) for o in offsets]
    coordinator, initial, _ = secure_federation(
        players, secagg=SecAggConfig(neighbors=2, threshold=0.5, step_timeout_s=HANG_GUARD_S)
    )
    assert_adapter(coordinator, expected_mean(initial, offsets, [10] * 6))


# ------------------------------------------------------------------ rogues, dropouts


def _send_then_leave(kind: int, payload: Callable[[dict[str, Any]], Any]) -> Step:
    """A client that answers the task's first step with `payload(task)` and nothing more."""

    def step(conn: Connection, task: dict[str, Any], state: State, me: SecurePlayer) -> None:
        if kind == FedMsg.SA_MASKED:
            conn.send_tensors(kind, payload(task))
        else:
            conn.send_msg(kind, payload(task))

    return step


def _until(stop_at: int, *, then: Callable[..., None] | None = None) -> Step:
    """The honest protocol, stopped just before sending message type `stop_at` (then
    `then(conn, task, me)` instead, if given)."""

    def step(conn: Connection, task: dict[str, Any], state: State, me: SecurePlayer) -> None:
        original = conn.send_msg, conn.send_tensors

        class Stop(Exception):
            pass

        def guard(send: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(kind: int, payload: Any, **kw: Any) -> Any:
                if kind == stop_at:
                    if then is not None:
                        then(conn, task, payload, original)
                    raise Stop
                return send(kind, payload, **kw)

            return wrapped

        conn.send_msg, conn.send_tensors = guard(original[0]), guard(original[1])  # type: ignore[method-assign]
        try:
            honest(conn, task, state, me)
        except Stop:
            pass
        finally:
            conn.send_msg, conn.send_tensors = original  # type: ignore[method-assign]

    return step


ROGUE_KEYS = {
    "not_base64": lambda task: {"task": task["task"], "c": "%%%", "s": "%%%"},
    "short_key": lambda task: {
        "task": task["task"],
        "c": base64.b64encode(b"x" * 31).decode(),
        "s": base64.b64encode(b"y" * 32).decode(),
    },
    "not_an_object": lambda task: ["task", task["task"]],
}


@pytest.mark.parametrize("payload", ROGUE_KEYS.values(), ids=ROGUE_KEYS.keys())
def test_malformed_keys_are_refused_and_the_round_goes_on(secure_federation, payload) -> None:
    players = [SecurePlayer(0.01), SecurePlayer(0.02), SecurePlayer(0.03)]
    players.append(SecurePlayer(5.0, step=_send_then_leave(FedMsg.SA_KEYS, payload), name="r"))
    # "not_an_object" answers no task: the key step waits it out, and the honest keys (sent at
    # once) must come within it: 10 s, not the 2 s a busy machine could outlast
    secagg = SecAggConfig(step_timeout_s=10.0)
    coordinator, initial, rounds = secure_federation(players, secagg=secagg)
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03], [10] * 3))
    assert rounds[0]["clients"] == 3
    # "not_an_object" answers no task (no "task" field): dropped, not refused
    assert rounds[0]["refused"] == (0 if isinstance(payload({"task": 1}), list) else 1)


def test_a_secure_step_says_whom_it_waits_for_what_and_under_which_key(caplog) -> None:
    """The round's wait for a step names the clients still missing, the message, the round
    and the config key that bounds it, after 5 s and then every 30 s: on an injected clock
    read 0 (the deadline: 0 + 100 s), 0 (the first report due at 5), 1 (client 1's keys
    taken), 10 (report), 40 (report), 100 (the deadline)."""
    readings = iter([0.0, 0.0, 1.0, 10.0, 40.0, 100.0])
    inbox = SecureInbox(clock=lambda: next(readings))
    clients = [SimpleNamespace(client_id=c) for c in (1, 2, 3)]
    trained = {"w": torch.zeros(4)}
    step = SecureRound(
        inbox=inbox,
        clients=clients,
        trained=trained,
        round_index=0,
        neighbors=0,
        threshold=0.5,
        weight_cap=10,
        bound=1.0,
        step_timeout_s=100.0,
        input_timeout_s=600.0,
        declared={1: 10, 2: 10, 3: 10},
    )
    inbox.open({1: 7, 2: 8, 3: 9})
    assert inbox.offer(1, FedMsg.SA_KEYS, {"c": "k"}, task=7)
    with caplog.at_level(logging.INFO, logger="fed_learn.secure_inbox"):
        got = step._step(FedMsg.SA_KEYS, [1, 2, 3])
    assert got == {1: {"c": "k"}} and step.failures == {2, 3}
    what = "SA_KEYS in secure round 1 (fed.secagg.step_timeout_s=100)"
    assert [r.getMessage() for r in caplog.records if r.name == "fed_learn.secure_inbox"] == [
        f"waiting for 2 clients' {what} (ids [2, 3]), 90s left",
        f"waiting for 2 clients' {what} (ids [2, 3]), 60s left",
    ]


def _leave(conn, task, payload, send) -> None:
    conn.close()  # a dropout: the connection goes


def _bad_boxes(conn, task, payload, send) -> None:
    payload["boxes"] = {k: base64.b64encode(b"z" * 10).decode() for k in payload["boxes"]}
    send[0](FedMsg.SA_SHARES, payload)


def _float_mask(conn, task, payload, send) -> None:
    send[1](FedMsg.SA_MASKED, {"masked": torch.zeros(payload["masked"].numel())})


def _corrupt_share(conn, task, payload, send) -> None:
    for share in payload["shares"].values():
        raw = bytearray(base64.b64decode(share[2]))
        raw[0] ^= 0xFF
        share[2] = base64.b64encode(bytes(raw)).decode()
    send[0](FedMsg.SA_REVEAL, payload)


def _other_index(conn, task, payload, send) -> None:
    """Each revealed share under another holder's index: two shares at one point would break
    the interpolation (pycryptodome raised out of the unmasking, which crashed the round)."""
    for share in payload["shares"].values():
        share[1] = share[1] % 4 + 1
    send[0](FedMsg.SA_REVEAL, payload)


def test_a_reveal_under_another_holders_index_is_refused_the_sum_stays_right(
    secure_federation,
) -> None:
    rogue = SecurePlayer(0.04, step=_until(FedMsg.SA_REVEAL, then=_other_index), name="rogue")
    players = in_join_order([rogue, *(SecurePlayer(o) for o in (0.01, 0.02, 0.03))])
    coordinator, initial, rounds = secure_federation(players)
    # its masked input arrived: it counts; only its reveal is refused, the others suffice
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03, 0.04], [10] * 4))
    assert rounds[0]["refused"] == 1


def test_a_malformed_share_box_is_refused_and_the_round_goes_on(secure_federation) -> None:
    players = [SecurePlayer(0.01), SecurePlayer(0.02), SecurePlayer(0.03)]
    players.append(SecurePlayer(5.0, step=_until(FedMsg.SA_SHARES, then=_bad_boxes), name="r"))
    coordinator, initial, rounds = secure_federation(players)
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03], [10] * 3))
    assert rounds[0]["refused"] == 1


def test_a_malformed_masked_input_is_refused_its_masks_removed(secure_federation) -> None:
    """It shared its keys, so the others masked with it: its pairwise masks are rebuilt
    from its key's shares and taken out of the sum."""
    players = [SecurePlayer(0.01), SecurePlayer(0.02), SecurePlayer(0.03)]
    players.append(SecurePlayer(5.0, step=_until(FedMsg.SA_MASKED, then=_float_mask), name="r"))
    coordinator, initial, rounds = secure_federation(players)
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03], [10] * 3))
    assert rounds[0]["refused"] == 1 and rounds[0]["clients"] == 3


def test_a_client_gone_before_its_masked_input_is_recovered(secure_federation) -> None:
    players = [SecurePlayer(0.01), SecurePlayer(0.02), SecurePlayer(0.03)]
    players.append(SecurePlayer(5.0, step=_until(FedMsg.RESULT, then=_leave), name="quits"))
    coordinator, initial, rounds = secure_federation(players)
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03], [10] * 3))
    assert rounds[0]["clients"] == 3 and rounds[0]["failures"] == 1


def test_a_client_gone_after_its_masked_input_still_counts(secure_federation) -> None:
    players = [SecurePlayer(0.01), SecurePlayer(0.02), SecurePlayer(0.03)]
    players.append(
        SecurePlayer(0.04, step=_until(FedMsg.SA_REVEAL, then=_leave), name="quits late")
    )
    coordinator, initial, rounds = secure_federation(players)
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03, 0.04], [10] * 4))
    assert rounds[0]["clients"] == 4


def test_a_corrupt_share_is_traced_to_its_sender_and_the_sum_stays_right(
    secure_federation,
) -> None:
    """The coordinator rebuilds each secret from the `threshold` shares of lowest index (the
    owner's own, then its neighbours' by id): the liar joins first (the lowest id), so its false
    shares are used, fail the seed's commitment, and are traced to it by leaving one share out
    at a time. (A false share a rebuild does not use changes nothing and goes unseen.)"""
    liar = SecurePlayer(0.04, step=_until(FedMsg.SA_REVEAL, then=_corrupt_share), name="liar")
    players = in_join_order([liar, *(SecurePlayer(o) for o in (0.01, 0.02, 0.03))])
    coordinator, initial, rounds = secure_federation(players)
    assert liar.client_id == 0
    assert_adapter(coordinator, expected_mean(initial, [0.01, 0.02, 0.03, 0.04], [10] * 4))
    assert rounds[0]["refused"] == 1


def test_too_few_clients_fail_each_attempt_in_one_line_and_the_run_ends_saying_why(
    secure_federation, caplog
) -> None:
    """A round whose secure sum failed before any input came is not one of fed.rounds: it is
    tried again, up to 3 x fed.rounds times, then the run ends saying why."""
    players = [SecurePlayer(0.01)]
    # two stay connected and silent: each attempt waits out its key step, then fails
    players += [SecurePlayer(0.02, step=_until(FedMsg.SA_KEYS), name=f"q{i}") for i in range(2)]
    with caplog.at_level("WARNING"), pytest.raises(NotEnoughClientsError, match="3 round attempts"):
        # the silent two are waited out: a short step, which no honest answer has to beat
        secure_federation(players, rounds=1, secagg=SecAggConfig(step_timeout_s=2.0))
    failed = [r for r in caplog.records if "secure aggregation failed" in r.getMessage()]
    assert len(failed) == 3 and "the threshold is 2" in failed[0].getMessage()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"mode": "async"}, "fed.mode=async"),
        ({"aggregator": "median"}, "fed.aggregator=median"),
        ({"strategy": "svd"}, "fed.strategy=svd"),
        ({"compression": "topk"}, "fed.compression=topk"),
    ],
)
def test_secure_options_that_need_single_updates_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FedConfig(secure_aggregation=True, **bad)


REAL = [
    "model.lab_preset=debug",
    "tracking.wandb=false",
    "fed.num_clients=3",
    "fed.simulate=3",  # three virtual clients in one process (fed_learn.run.run_simulator)
    "fed.rounds=2",
    "fed.local_steps=10",
    "fed.max_examples_per_client=512",
    "fed.eval_blocks=16",
    "fed.centralized_baseline=false",
]


def test_a_real_secure_run_with_dropouts_trains(compose_config, tiny_models: Path) -> None:
    """Real LoRA clients (LoRAClient's secure path, 4 simulated in one process), one of them
    dropping out of each round after the keys are shared (fed.simulate_dropout's seeded draws
    pick client 1 in round 1 and client 0 in round 2; each joins again): every round unmasks
    the other three, the loss falls, nothing is refused, and the run ends cleanly."""
    secured = run(
        compose_config(
            "fed_learn",
            [
                *REAL,
                "fed.num_clients=4",
                "fed.simulate=4",
                "fed.simulate_dropout=0.4",
                "fed.secure_aggregation=true",
            ],
        )
    )
    assert secured["final_val_loss"] < secured["initial_val_loss"]
    assert secured["mean_clients_per_round"] == 3
    assert secured["refused"] == 0 and secured["coordinator_peak_rss_mib"] > 0


@pytest.mark.slow
def test_a_real_secure_run_trains_as_the_plain_one(compose_config, tiny_models: Path) -> None:
    """The same seeds, plain and secure: the validation losses are equal (the sum differs
    by rounding alone), and the masked uint64 updates cost more bytes than float32 ones."""
    plain = run(compose_config("fed_learn", REAL))
    secured = run(compose_config("fed_learn", [*REAL, "fed.secure_aggregation=true"]))
    assert secured["final_val_loss"] == pytest.approx(plain["final_val_loss"], rel=1e-5)
    assert secured["bytes_up_per_round"] > plain["bytes_up_per_round"]


# ------------------------------------------------------------------ DP-FedAvg


def _noise_on_mean(coordinator: Coordinator, initial: State, offsets, weights) -> float:
    got, expected = adapter_state(coordinator.model), expected_mean(initial, offsets, weights)
    diff = torch.cat([(got[n].double() - expected[n].double()).reshape(-1) for n in expected])
    return float(diff.std())


@pytest.mark.parametrize("secure_aggregation", [True, False])
def test_dp_noise_on_the_mean_is_what_the_accountant_is_told(
    secure_federation, secure_aggregation: bool
) -> None:
    """Clip above every update (nothing clipped): the adapter is the plain mean plus noise of
    std sigma x clip x cap / (sum of capped weights): the whole noise, central or summed from
    the clients' shares (over-noised by sqrt(3 / threshold 2) then). The accountant spent
    epsilon for that sigma, logged with the round."""
    sigma, clip, cap = 0.5, 4.0, 10
    dp = DPConfig(enabled=True, clip_norm=clip, noise_multiplier=sigma, weight_cap=cap)
    players = [SecurePlayer(0.01, 10), SecurePlayer(0.02, 10), SecurePlayer(0.03, 10)]
    if not secure_aggregation:
        players = [SecurePlayer(o, 10, step=plain_answer, name="plain") for o in (0.01, 0.02, 0.03)]
    coordinator, initial, rounds = secure_federation(
        players, dp=dp, secure_aggregation=secure_aggregation
    )
    measured = _noise_on_mean(coordinator, initial, [0.01, 0.02, 0.03], [10] * 3)
    expected = sigma * clip * cap / 30 * (math.sqrt(3 / 2) if secure_aggregation else 1.0)
    assert measured == pytest.approx(expected, rel=0.05)
    accountant = Accountant("rdp")
    accountant.step(noise_multiplier=sigma, sample_rate=1.0)
    assert rounds[0]["dp_epsilon"] == pytest.approx(accountant.epsilon(1e-5))


def plain_answer(conn: Connection, task: dict[str, Any], state: State, me: SecurePlayer) -> None:
    result, local, _ = honest_train(task, state, me.offset, me.examples)
    conn.send_msg(FedMsg.RESULT, result)
    conn.send_tensors(FedMsg.UPDATE, local)


def test_dp_clipping_bounds_what_one_client_moves(secure_federation) -> None:
    """A client far off (offset 5 on every entry) moves the mean by at most clip x its
    capped weight / the weights' sum, noise aside (sigma tiny here)."""
    dp = DPConfig(enabled=True, clip_norm=0.5, noise_multiplier=1e-6, weight_cap=10)
    players = [SecurePlayer(0.0, 10), SecurePlayer(0.0, 10), SecurePlayer(5.0, 10, name="far")]
    coordinator, initial, _ = secure_federation(players, dp=dp)
    got = adapter_state(coordinator.model)
    moved = torch.cat([(got[n].double() - initial[n].double()).reshape(-1) for n in initial])
    assert float(moved.norm()) == pytest.approx(0.5 * 10 / 30, rel=1e-3)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"mode": "async"}, "fed.mode=async"),
        ({"aggregator": "median"}, "fed.aggregator=median"),
        ({"strategy": "svd"}, "fed.strategy=svd"),
    ],
)
def test_dp_options_that_break_its_sum_are_refused(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"fed.dp.enabled=true with {message}"):
        FedConfig(dp=DPConfig(enabled=True), **bad)


def test_simulation_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"fed\.simulate_dropout applies to simulated clients"):
        FedConfig(simulate_dropout=0.1)
    with pytest.raises(ValueError, match=r"fed.simulate_dropout=1.0 must be in \[0, 1\)"):
        FedConfig(simulate=10, simulate_dropout=1.0)
    with pytest.raises(ValueError, match=r"fed\.simulate=-1 must be >= 0"):
        FedConfig(simulate=-1)


@pytest.mark.parametrize("sent", [None, 7, [1, 2], "boxes"])
def test_a_relayed_field_of_the_wrong_type_leaves_the_round_not_the_process(sent: object) -> None:
    """A roster's keys, the boxes or the holder lists that are not an object end the client's
    round with a ValueError (its loop answers it), never a TypeError that kills the process."""
    from fed_learn.secure import _mapping

    with pytest.raises(ValueError, match="holders is a"):
        _mapping({"holders": sent}, "holders")
    assert _mapping({"holders": {"3": [3, 1]}}, "holders") == {"3": [3, 1]}
    assert _mapping({}, "holders") == {}
