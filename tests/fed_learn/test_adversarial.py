"""A live coordinator against rogue clients over real netproto connections.

The honest clients here are scripted: each answers a task with the global adapter plus a fixed
offset on every entry, so the round's aggregate is known exactly and any trace of a rogue's
update in it shows. A rogue answers with whatever its test sends. Every test checks that the
round went on with the honest clients, that the rogue's failure (or dropped result) was counted
and that the global adapter stayed finite.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch

from fed_learn.aggregate import coordinate_median, fedavg
from fed_learn.compression import compress, decompress
from fed_learn.config import DPConfig, FedConfig, FedLearnRunConfig
from fed_learn.coordinator import Coordinator
from fed_learn.lora import adapter_state, peft_model
from fed_learn.protocol import FedMsg
from fed_learn.strategy import Strategy
from lab.cluster import connect, serve
from lab.config import Endpoint, ModelConfig, PathsConfig, TrackingConfig
from lab.tracking import METRICS_FILE, Tracker, read_records
from labtools.attacks.secure_rounds import offset_delta, result_for
from netproto import Connection, NetprotoError, RemoteError
from netproto.header import Header, PayloadKind, pack_header
from tests.clocks import HANG_GUARD_S

MODEL = ModelConfig(pretrained="lab:tiny_target", lab_preset="debug")
State = dict[str, torch.Tensor]
Answer = Callable[[Connection, dict[str, Any], State], None]
"""What a scripted client does with a task and its global adapter: send what it likes."""

ROGUE_OFFSET = 5.0
"""A rogue's update moves every entry by this: far from any honest one (0.01 to 0.06)."""


# ---------------------------------------------------------------- scripted clients


def wire_update(task: dict[str, Any], global_state: State, delta: State) -> State:
    """What a client sends for `delta` under the task's compression."""
    method = task["compression"]
    if method == "none":
        return {name: global_state[name] + delta[name] for name in global_state}
    return compress(delta, method=method, fraction=task["topk_fraction"])


def received(method: str, global_state: State, delta: State) -> State:
    """The full adapter the coordinator rebuilds from `delta` sent under `method`."""
    if method == "none":
        return {name: global_state[name] + delta[name] for name in global_state}
    wire = compress(delta, method=method, fraction=1.0)
    sent = decompress(wire, method=method, shapes={n: t.shape for n, t in delta.items()})
    return {name: global_state[name].float() + sent[name] for name in global_state}


def honest(offset: float, *, num_examples: int = 10, keys: str = "") -> Answer:
    def answer(conn: Connection, task: dict[str, Any], global_state: State) -> None:
        delta = offset_delta(global_state, offset, keys=keys)
        conn.send_msg(FedMsg.RESULT, result_for(task, num_examples=num_examples))
        conn.send_tensors(FedMsg.UPDATE, wire_update(task, global_state, delta))

    return answer


def rogue(
    result: Callable[[dict[str, Any]], dict[str, Any]] = result_for,
    update: Callable[[dict[str, Any], State], State] | None = None,
) -> Answer:
    """Answers every task with `result(task)` and `update(task, global)` (default: a far one)."""

    def answer(conn: Connection, task: dict[str, Any], global_state: State) -> None:
        conn.send_msg(FedMsg.RESULT, result(task))
        conn.send_tensors(
            FedMsg.UPDATE,
            update(task, global_state)
            if update is not None
            else wire_update(task, global_state, offset_delta(global_state, ROGUE_OFFSET)),
        )

    return answer


class Plays(Protocol):
    """A scripted client: plays its part over `conn` until FINISH (or it is cut off)."""

    def play(self, conn: Connection) -> None: ...


@dataclass
class Player:
    answer: Answer
    join_examples: int = 10
    name: str = "honest"
    before_tasks: Callable[[Connection], None] | None = None
    """Sent right after WELCOME, before any task has arrived."""
    errors: list[BaseException] = field(default_factory=list)

    def play(self, conn: Connection) -> None:
        try:
            conn.request(
                FedMsg.JOIN,
                {"name": self.name, "num_examples": self.join_examples},
                expect=FedMsg.WELCOME,
            )
            if self.before_tasks is not None:
                self.before_tasks(conn)
            while True:
                message = conn.recv(expect={FedMsg.TASK, FedMsg.FINISH})
                if message.type == FedMsg.FINISH:
                    return
                global_state = conn.recv_tensors(FedMsg.GLOBAL)
                self.answer(conn, message.payload, global_state)
        except NetprotoError as exc:  # a rogue the coordinator cut off
            self.errors.append(exc)
        finally:
            conn.close()


@dataclass
class Federation:
    coordinator: Coordinator
    initial: State
    players: Sequence[Plays]
    tmp_path: Path
    coordinator_address: tuple[str, int]

    def run(self) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Run every round; (the run's metrics, each round's metrics record)."""
        with Tracker(
            self.tmp_path,
            config={},
            tracking=TrackingConfig(wandb=False, console=False),
            job="test",
        ) as tracker:
            metrics = self.coordinator.run_rounds(tracker)
        rounds = [r for r in read_records(self.tmp_path / METRICS_FILE) if "clients" in r]
        assert all(math.isfinite(r["val_loss"]) for r in rounds)
        assert all(bool(torch.isfinite(t).all()) for t in self.final().values())
        return metrics, rounds

    def final(self) -> State:
        return adapter_state(self.coordinator.model)

    def client(self, name: str) -> Any:
        """The coordinator's handle of client `name`: take it before `run` (a client that
        leaves is dropped from the coordinator's table; the handle keeps its counts)."""
        [handle] = [c for c in self.coordinator.alive_clients() if c.name == name]
        return handle


@pytest.fixture
def federation(tiny_models: Path, lab_cache: Path, tmp_path: Path) -> Iterator[Callable]:
    servers, threads = [], []

    def start(players: Sequence[Plays], **fed: Any) -> Federation:
        settings = FedLearnRunConfig(
            model=MODEL,
            fed=replace(
                FedConfig(
                    rounds=1,
                    num_clients=len(players),
                    min_fit_clients=2,
                    round_timeout_s=30,
                    wait_clients_s=10,
                    max_examples_per_client=32,
                    eval_blocks=4,
                    heartbeat_s=0.5,
                    heartbeat_timeout_s=20,
                ),
                **fed,
            ),
            paths=PathsConfig(run_dir=str(tmp_path), cache_dir=str(lab_cache)),
            tracking=TrackingConfig(wandb=False, console=False),
        )
        model = peft_model(MODEL, settings.lora, cache_dir=lab_cache)
        coordinator = Coordinator(settings, model, torch.randint(0, 300, (4, 32)))
        server = serve(coordinator.handle, settings.cluster, Endpoint(), name="coordinator")
        servers.append(server)
        for player in players:
            conn = connect(settings.cluster, server.address)
            threads.append(threading.Thread(target=player.play, args=(conn,), daemon=True))
            threads[-1].start()
        coordinator.wait_for_clients(len(players))
        return Federation(coordinator, adapter_state(model), players, tmp_path, server.address)

    yield start
    for server in servers:
        server.stop()
    for thread in threads:
        thread.join(timeout=HANG_GUARD_S)
    assert not any(thread.is_alive() for thread in threads), "a scripted client hung"


def honest_mean(initial: State, offsets: list[float], *, method: str = "none") -> State:
    """The global adapter a round of honest clients with `offsets` (equal weights) yields."""
    return fedavg([(received(method, initial, offset_delta(initial, o)), 10) for o in offsets])


def assert_states_equal(got: State, expected: State) -> None:
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- malformed RESULTs


def drop(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda task: {k: v for k, v in result_for(task).items() if k != key}


def with_fields(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda task: result_for(task, **fields)


MALFORMED_RESULTS = {
    "num_examples_missing": drop("num_examples"),
    "num_examples_zero": with_fields(num_examples=0),
    "num_examples_negative": with_fields(num_examples=-10),
    "num_examples_string": with_fields(num_examples="10"),
    "train_loss_missing": drop("train_loss"),
    "round_string": lambda task: result_for(task, round=str(task["round"])),
    "round_null": with_fields(round=None),
    "round_of_another_round": lambda task: result_for(task, round=task["round"] + 1),
}


@pytest.mark.parametrize("result", MALFORMED_RESULTS.values(), ids=MALFORMED_RESULTS.keys())
def test_a_malformed_result_is_that_clients_failure_and_the_round_goes_on(
    federation, result
) -> None:
    fed = federation([Player(honest(0.01)), Player(honest(0.02)), Player(rogue(result))])
    _, [record] = fed.run()
    assert (record["clients"], record["failures"], record["refused"]) == (2, 1, 1)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02]))


def test_a_result_with_nan_train_loss_cuts_the_rogue_off_and_the_round_goes_on(
    federation,
) -> None:
    """JSON has no NaN: netproto refuses the frame and closes that connection only."""

    def nan_loss(conn: Connection, task: dict[str, Any], global_state: State) -> None:
        data = (
            f'{{"task": {task["task"]}, "round": {task["round"]}, "num_examples": 10, '
            '"train_loss": NaN, "val_loss": 1.0, "seconds": 0.1}'
        ).encode()
        header = Header(FedMsg.RESULT, PayloadKind.JSON, 0, 0, len(data))
        conn._sendall([pack_header(header), data])  # what a hand-made peer can send
        with contextlib.suppress(NetprotoError):
            conn.send_tensors(FedMsg.UPDATE, global_state)

    fed = federation([Player(honest(0.01)), Player(honest(0.02)), Player(nan_loss)])
    _, [record] = fed.run()
    assert (record["clients"], record["failures"]) == (2, 1)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02]))


# ---------------------------------------------------------------- non-finite and huge updates


def poisoned(tensor_name: str, value: float) -> Callable[[dict[str, Any], State], State]:
    """An update, as the task's compression sends it, with `value` in one of its tensors."""

    def update(task: dict[str, Any], global_state: State) -> State:
        wire = wire_update(task, global_state, offset_delta(global_state, 0.03))
        name = tensor_name or sorted(wire)[0]
        wire[name] = wire[name].clone()
        wire[name].view(-1)[0] = value
        return wire

    return update


BAD_UPDATES = {
    "dense-nan": ("none", "", math.nan),
    "dense-inf": ("none", "", math.inf),
    "dense-3e38": ("none", "", 3e38),
    "topk-nan": ("topk", "val", math.nan),
    "topk-inf": ("topk", "val", -math.inf),
    "topk-3e38": ("topk", "val", 3e38),
    "topk_int8-scale-nan": ("topk_int8", "scale", math.nan),
    "topk_int8-scale-inf": ("topk_int8", "scale", math.inf),
    "topk_int8-scale-3e38": ("topk_int8", "scale", 3e38),
}


@pytest.mark.parametrize(
    ("method", "tensor_name", "value"), BAD_UPDATES.values(), ids=BAD_UPDATES.keys()
)
def test_a_non_finite_or_huge_update_is_refused_and_the_round_goes_on(
    federation, method: str, tensor_name: str, value: float
) -> None:
    players = [
        Player(honest(0.01)),
        Player(honest(0.02)),
        Player(rogue(update=poisoned(tensor_name, value))),
    ]
    fed = federation(players, compression=method, topk_fraction=1.0)
    _, [record] = fed.run()
    assert (record["clients"], record["failures"], record["refused"]) == (2, 1, 1)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02], method=method))


def test_a_float64_update_too_big_for_the_adapters_dtype_is_refused(federation) -> None:
    def overflowing(task: dict[str, Any], global_state: State) -> State:
        return {name: t.double() + 1e300 for name, t in global_state.items()}

    players = [Player(honest(0.01)), Player(honest(0.02)), Player(rogue(update=overflowing))]
    fed = federation(players)
    _, [record] = fed.run()
    assert (record["clients"], record["refused"]) == (2, 1)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02]))


@pytest.mark.parametrize("method", ["none", "topk"])
@pytest.mark.parametrize(
    "dtype", [torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.complex64, torch.bool]
)
def test_an_update_in_a_dtype_without_arithmetic_is_refused_and_the_round_goes_on(
    federation, method: str, dtype: torch.dtype
) -> None:
    """float4 has no isfinite (it once ended run_rounds); nothing but adapter dtypes passes."""

    def odd(task: dict[str, Any], global_state: State) -> State:
        wire = wire_update(task, global_state, offset_delta(global_state, 0.03))
        name = "val" if method == "topk" else sorted(wire)[0]
        wire[name] = torch.zeros(wire[name].shape, dtype=dtype)
        return wire

    players = [Player(honest(0.01)), Player(honest(0.02)), Player(rogue(update=odd))]
    fed = federation(players, compression=method, topk_fraction=1.0)
    _, [record] = fed.run()
    assert (record["clients"], record["failures"], record["refused"]) == (2, 1, 1)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02], method=method))


def test_an_update_above_max_update_norm_is_refused_below_it_admitted(federation) -> None:
    # The rogue's offset of 5.0 on 17k entries is a norm of about 660.
    players = [Player(honest(0.01)), Player(honest(0.02)), Player(rogue())]
    fed = federation(players, max_update_norm=600.0)
    _, [record] = fed.run()
    assert (record["clients"], record["refused"]) == (2, 1)
    assert record["largest_update_norm"] < 10  # the honest ones'
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02]))


# ---------------------------------------------------------------- claimed weight


def test_a_huge_num_examples_gets_no_more_weight_than_declared_at_join(federation) -> None:
    huge = rogue(result=lambda task: result_for(task, num_examples=10**12))
    players = [Player(honest(0.01)), Player(honest(0.02)), Player(huge, name="rogue")]
    fed = federation(players, max_update_norm=1000.0)
    _, [record] = fed.run()
    assert (record["clients"], record["failures"]) == (3, 0)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02, ROGUE_OFFSET]))


def test_a_huge_join_declaration_is_capped_by_max_examples_per_client(federation) -> None:
    huge = rogue(result=lambda task: result_for(task, num_examples=10**12))
    players = [
        Player(honest(0.01, num_examples=32), join_examples=32),
        Player(honest(0.02, num_examples=32), join_examples=32),
        Player(huge, join_examples=10**12, name="rogue"),
    ]
    fed = federation(players, max_update_norm=1000.0)  # max_examples_per_client=32
    handle = fed.client("rogue")
    fed.run()
    assert handle.num_examples == 32
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02, ROGUE_OFFSET]))


# ---------------------------------------------------------------- unsolicited, duplicate, stale


def test_unsolicited_results_sent_before_any_task_are_dropped_not_queued(federation) -> None:
    """40 RESULT + UPDATE pairs, built before the round's adapter was sent (a guessed task
    number, the right round): none is queued or used; the rogue's real answer is."""

    def flood(conn: Connection) -> None:
        state = {f"t{i}": torch.full((64, 64), ROGUE_OFFSET) for i in range(4)}
        guessed = {"task": 0, "compression": "none", "round": 0}
        for _ in range(40):
            conn.send_msg(FedMsg.RESULT, result_for(guessed))
            conn.send_tensors(FedMsg.UPDATE, state)

    players = [
        Player(honest(0.01)),
        Player(honest(0.02)),
        Player(honest(0.03), name="rogue", before_tasks=flood),
    ]
    fed = federation(players)
    handle = fed.client("rogue")
    metrics, [record] = fed.run()
    assert metrics["dropped_results"] == 40
    assert handle.dropped == 40
    assert (record["clients"], record["failures"]) == (3, 0)
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.01, 0.02, 0.03]))


def two_rounds_expected(initial: State, first: list[float], second: list[float]) -> State:
    after_first = honest_mean(initial, first)
    return honest_mean(after_first, second)


def test_a_duplicate_result_is_dropped_and_not_used_in_the_next_round(federation) -> None:
    def twice(conn: Connection, task: dict[str, Any], global_state: State) -> None:
        offset = 0.03 if task["round"] == 0 else 0.06
        repeats = 2 if task["round"] == 0 else 1
        for _ in range(repeats):
            honest(offset)(conn, task, global_state)

    players = [Player(honest(0.01)), Player(honest(0.02)), Player(twice, name="rogue")]
    fed = federation(players, rounds=2)
    metrics, rounds = fed.run()
    assert metrics["dropped_results"] == 1
    assert [(r["clients"], r["failures"]) for r in rounds] == [(3, 0), (3, 0)]
    expected = two_rounds_expected(fed.initial, [0.01, 0.02, 0.03], [0.01, 0.02, 0.06])
    assert_states_equal(fed.final(), expected)


def test_a_stale_result_for_an_earlier_round_is_dropped(federation) -> None:
    saved: list[tuple[dict[str, Any], State]] = []

    def replays(conn: Connection, task: dict[str, Any], global_state: State) -> None:
        if task["round"] == 0:
            update = {n: t + 0.03 for n, t in global_state.items()}
            saved.append((result_for(task), update))
            conn.send_msg(FedMsg.RESULT, saved[0][0])
            conn.send_tensors(FedMsg.UPDATE, update)
            return
        stale_result, stale_update = saved[0]  # round 1's answer again, then the real one
        conn.send_msg(FedMsg.RESULT, stale_result)
        conn.send_tensors(FedMsg.UPDATE, {n: t + ROGUE_OFFSET for n, t in stale_update.items()})
        honest(0.06)(conn, task, global_state)

    players = [Player(honest(0.01)), Player(honest(0.02)), Player(replays, name="rogue")]
    fed = federation(players, rounds=2)
    metrics, rounds = fed.run()
    assert metrics["dropped_results"] == 1
    assert [(r["clients"], r["failures"]) for r in rounds] == [(3, 0), (3, 0)]
    expected = two_rounds_expected(fed.initial, [0.01, 0.02, 0.03], [0.01, 0.02, 0.06])
    assert_states_equal(fed.final(), expected)


def test_an_answer_after_its_rounds_deadline_is_dropped_in_the_next_round(federation) -> None:
    """The rogue keeps round 1's task unanswered past the deadline, then hands it in once
    round 2's task has come (so surely late), before its real answer to round 2."""
    first_task: list[dict[str, Any]] = []

    def late(conn: Connection, task: dict[str, Any], global_state: State) -> None:
        if task["round"] == 0:
            first_task.append(task)
            return
        conn.send_msg(FedMsg.RESULT, result_for(first_task[0]))
        conn.send_tensors(FedMsg.UPDATE, {n: t + ROGUE_OFFSET for n, t in global_state.items()})
        honest(0.06)(conn, task, global_state)

    players = [Player(honest(0.01)), Player(honest(0.02)), Player(late, name="rogue")]
    fed = federation(players, rounds=2, round_timeout_s=2.0)
    metrics, rounds = fed.run()
    assert [(r["clients"], r["failures"]) for r in rounds] == [(2, 1), (3, 0)]
    assert metrics["dropped_results"] == 1
    expected = two_rounds_expected(fed.initial, [0.01, 0.02], [0.01, 0.02, 0.06])
    assert_states_equal(fed.final(), expected)


def test_a_malformed_join_is_refused_and_others_still_join(federation, lab_cache) -> None:
    fed = federation([Player(honest(0.01)), Player(honest(0.02))])
    settings = fed.coordinator.settings
    address = fed.coordinator_address
    for bad in ({"name": "x", "num_examples": "10"}, {"name": ["x"], "num_examples": 10}):
        with connect(settings.cluster, address) as conn, pytest.raises(RemoteError) as caught:
            conn.request(FedMsg.JOIN, bad, expect=FedMsg.WELCOME)
        assert caught.value.code == "bad_request"
    assert len(fed.coordinator.clients) == 2
    _, [record] = fed.run()
    assert record["clients"] == 2


# ---------------------------------------------------------------- strategies' own rules


def test_an_ffa_client_that_moved_a_is_refused_not_fatal(federation) -> None:
    players = [
        Player(honest(0.01, keys="lora_B")),
        Player(honest(0.02, keys="lora_B")),
        Player(rogue()),  # moves A as well
    ]
    fed = federation(players, strategy="ffa")
    _, [record] = fed.run()
    assert (record["clients"], record["refused"]) == (2, 1)
    expected = fedavg(
        [
            (received("none", fed.initial, offset_delta(fed.initial, o, keys="lora_B")), 10)
            for o in (0.01, 0.02)
        ]
    )
    assert_states_equal(fed.final(), expected)


# ---------------------------------------------------------------- async mode


ASYNC_ROGUES = {
    "round_string": rogue(result=lambda task: result_for(task, round=str(task["round"]))),
    "round_null": rogue(result=with_fields(round=None)),
    "num_examples_string": rogue(result=with_fields(num_examples="10")),
    "nan_update": rogue(update=poisoned("", math.nan)),
    "3e38_update": rogue(update=poisoned("", 3e38)),
}


@pytest.mark.parametrize("answer", ASYNC_ROGUES.values(), ids=ASYNC_ROGUES.keys())
def test_async_mode_refuses_a_bad_answer_and_goes_on(federation, answer: Answer) -> None:
    players = [Player(honest(0.01)), Player(honest(0.02)), Player(answer)]
    fed = federation(players, mode="async", rounds=2, max_update_norm=1000.0)
    metrics, _ = fed.run()
    assert metrics["applied"] == 4 and metrics["refused"] >= 1
    # Each applied update mixes in (weight <= 0.5) an adapter at most 0.02 above one the
    # global was at: four of them raise an entry by 0.04 at most. A rogue's +5, mixed in with
    # weight >= 0.2, would show.
    for name, tensor in fed.final().items():
        moved = tensor - fed.initial[name]
        assert moved.min() >= -1e-6 and moved.max() <= 0.04 + 1e-6, name


# ---------------------------------------------------------------- robust aggregation


@pytest.mark.parametrize("strategy", ["fedavg", "ffa", "svd"])
def test_median_keeps_two_attackers_of_five_out_of_the_global_adapter(
    federation, strategy: str
) -> None:
    keys = "lora_B" if strategy == "ffa" else ""
    offsets = [0.01, 0.02, 0.03, ROGUE_OFFSET, ROGUE_OFFSET]
    players = [Player(honest(o, keys=keys)) for o in offsets]
    fed = federation(players, strategy=strategy, aggregator="median", max_update_norm=1000.0)
    _, [record] = fed.run()
    assert record["clients"] == 5
    updates = [
        (received("none", fed.initial, offset_delta(fed.initial, o, keys=keys)), 10)
        for o in offsets
    ]
    median = Strategy.create(strategy, rank=8, combine=coordinate_median)
    assert_states_equal(fed.final(), median.aggregate(updates))
    if strategy != "svd":  # per entry: the third of the five values, an honest one's
        assert_states_equal(fed.final(), updates[2][0])


def test_trimmed_mean_keeps_one_attacker_of_five_out_of_the_global_adapter(federation) -> None:
    offsets = [0.01, 0.02, 0.03, 0.04, ROGUE_OFFSET]
    fed = federation(
        [Player(honest(o)) for o in offsets],
        aggregator="trimmed_mean",
        trim_fraction=0.2,
        max_update_norm=1000.0,
    )
    _, [record] = fed.run()
    assert record["clients"] == 5
    # one value cut at each end of every entry: the mean of 0.02, 0.03 and 0.04
    assert_states_equal(fed.final(), honest_mean(fed.initial, [0.02, 0.03, 0.04]))


# ---------------------------------------------------------------- DP in the clear


def test_dp_in_the_clear_bounds_what_one_client_moves(federation) -> None:
    """fed.dp without secure aggregation: the coordinator's DPMean around FedAvg clips each
    update, so a client far off (offset 1.0 on ~17k entries, a norm of ~130, under
    fed.max_update_norm) moves the adapter by clip x its capped weight / the sampled clients'
    capped weights (noise aside: sigma tiny here); the privacy spent is reported."""
    dp = DPConfig(enabled=True, clip_norm=0.5, noise_multiplier=1e-6, weight_cap=10)
    players = [Player(honest(0.0)), Player(honest(0.0)), Player(honest(1.0), name="far")]
    fed = federation(players, dp=dp, max_update_norm=600.0)
    metrics, [record] = fed.run()
    assert record["clients"] == 3
    moved = torch.cat(
        [(fed.final()[n].double() - t.double()).reshape(-1) for n, t in fed.initial.items()]
    )
    assert float(moved.norm()) == pytest.approx(0.5 * 10 / 30, rel=1e-3)
    assert metrics["dp_epsilon"] > 0 and metrics["dp_noise_multiplier"] == 1e-6
