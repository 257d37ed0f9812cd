"""A coordinator that announces a secure round of too many clients: the client leaves that round
in one line before it builds anything (fed.secagg.max_clients), and takes the next round as
usual; and the round's graph is worked out per client, so no party ever holds all of it."""

from __future__ import annotations

import logging
import random
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch

from fed_learn import secagg, secure
from fed_learn.client import LoRAClient
from fed_learn.config import FedConfig, SecAggConfig
from fed_learn.lora import adapter_state, peft_model
from fed_learn.protocol import FedMsg
from fed_learn.secagg_params import MAX_CLIENTS, Params
from lab.cluster import connect, serve
from lab.config import Endpoint
from labtools.attacks.join_loop import MODEL, settings
from netproto import Connection

EVERYONE = MAX_CLIENTS + 1
"""Every client id there is: the most a round's parameters can list."""


def _plain_task(number: int, round_index: int) -> dict[str, Any]:
    return {
        "task": number,
        "round": round_index,
        "strategy": "fedavg",
        "local_epochs": 1,
        "local_steps": 1,
        "batch_size": 2,
        "lr": 1e-3,
        "compression": "none",
        "topk_fraction": 0.05,
    }


def _huge_round(neighbors: int) -> dict[str, Any]:
    """A secure round's parameters listing every client id (a complete graph for
    `neighbors` >= EVERYONE - 1: ~2^32 entries held whole)."""
    degree = min(neighbors, EVERYONE - 1)
    return {
        "noise_std": 0.0,
        "round": 0,
        "clients": list(range(EVERYONE)),
        "threshold": degree // 2 + 1,
        "neighbors": neighbors,
        "frac_bits": 16,
        "length": 10,
        "graph_seed": "AAAAAAAAAAA=",
        "weight_cap": 8,
        "bound": 1.0,
    }


@pytest.mark.parametrize("capped", [True, False], ids=["checked", "control"])
def test_a_round_of_too_many_clients_costs_the_client_only_that_round(
    tmp_path: Path, lab_cache: Path, monkeypatch, caplog, capped: bool
) -> None:
    """A lying coordinator lists all 65,536 client ids in a complete-graph secure round, then
    sends a plain round. Checked: the client leaves the secure round naming the key, builds no
    secagg.Client (sends no SA_KEYS), then trains the plain round. Control (the cap raised to
    every id): the client goes on to build the round's client; a stand-in stops it there."""
    run = settings(tmp_path, lab_cache)
    model = peft_model(MODEL, run.lora, cache_dir=lab_cache)
    built: list[int] = []

    class Stopped(ValueError):
        pass

    def stand_in(client_id: int, params: Params) -> Any:  # the control arm gets this far
        built.append(len(params.clients))
        raise Stopped("the round's client would be built here")

    monkeypatch.setattr(secagg, "Client", stand_in)
    seen: list[int] = []
    finished = threading.Event()

    def coordinator(conn: Connection) -> None:  # the lying coordinator's side, scripted
        join = conn.recv(expect=FedMsg.JOIN, timeout_s=30)
        conn.send_msg(FedMsg.WELCOME, {"client_id": 7}, request_id=join.request_id)
        state = adapter_state(model)
        conn.send_msg(FedMsg.TASK, {**_plain_task(1, 0), "secure": _huge_round(EVERYONE)})
        conn.send_tensors(FedMsg.GLOBAL, state)
        conn.send_msg(FedMsg.TASK, _plain_task(2, 1))
        conn.send_tensors(FedMsg.GLOBAL, state)
        answer = conn.recv(expect={FedMsg.RESULT, FedMsg.SA_KEYS}, timeout_s=60)
        seen.append(answer.type)
        if answer.type == FedMsg.RESULT:
            seen.append(conn.recv(expect=FedMsg.UPDATE, timeout_s=60).type)
        conn.send(FedMsg.FINISH)
        finished.wait(30)

    server = serve(coordinator, run.cluster, Endpoint(), name="liar")
    try:
        client = LoRAClient(
            model,
            torch.randint(0, 300, (4, 16)),
            torch.randint(0, 300, (2, 16)),
            name="victim",
            max_round_clients=EVERYONE if not capped else SecAggConfig.max_clients,
        )
        with caplog.at_level(logging.WARNING), connect(run.cluster, server.address) as conn:
            rounds = client.run(conn, heartbeat_s=5.0, timeout_s=60)
        finished.set()
    finally:
        server.stop()
    assert rounds == 1  # the plain round, after the refused one
    assert seen == [FedMsg.RESULT, FedMsg.UPDATE]  # no SA_KEYS went out
    left = [r.getMessage() for r in caplog.records if "left the secure round" in r.getMessage()]
    assert len(left) == 1
    if capped:
        assert built == []  # refused before anything of the round was built
        assert "lists 65536 clients" in left[0] and "fed.secagg.max_clients" in left[0]
        assert f"at most {SecAggConfig.max_clients}" in left[0]
    else:
        assert built == [EVERYONE]


def test_parse_params_refuses_more_clients_than_the_cap_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"lists 11 clients; .* at most 10 \(fed.secagg"):
        secure.parse_params({**_huge_round(4), "clients": list(range(11))}, max_clients=10)
    with pytest.raises(ValueError, match="list no clients"):
        secure.parse_params({**_huge_round(4), "clients": "0,1,2"}, max_clients=10)
    params, *_ = secure.parse_params(
        {**_huge_round(4), "clients": list(range(10)), "threshold": 3}, max_clients=10
    )
    assert params.clients == tuple(range(10))


@pytest.mark.parametrize(
    ("field", "value"),
    [("bound", 10**400), ("noise_std", 10**400), ("round", 2**32), ("round", -1)],
)
def test_a_lying_coordinators_out_of_range_number_costs_the_round_not_the_client(
    field: str, value: int
) -> None:
    """A JSON integer too big for a float, or a round that cannot travel in 32 bits: a
    ValueError the client's round loop catches (an OverflowError or struct.error would have
    ended the client process)."""
    payload = {**_huge_round(4), "clients": list(range(10)), "threshold": 3, field: value}
    with pytest.raises(ValueError):
        secure.parse_params(payload, max_clients=10)


def test_a_client_works_out_its_neighbours_without_the_whole_graph() -> None:
    """All 65,536 ids at SecAgg+'s degree 14: a client's neighbourhood comes from the shuffled
    ring alone (megabytes), never the graph; and it is the one the coordinator relays by."""
    params = Params(
        round=0,
        clients=tuple(range(EVERYONE)),
        threshold=8,
        neighbors=14,
        frac_bits=16,
        length=10,
        graph_seed=b"12345678",
    )
    tracemalloc.start()
    try:
        mine = params.neighbours(4242)
        theirs = [params.neighbours(c) for c in mine]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(mine) == 14 and 4242 not in mine
    assert all(4242 in t for t in theirs)  # symmetric
    assert peak < 64 * 2**20  # the complete graph's would be ~2^32 entries
    for count, degree in ((20, 5), (21, 5), (21, 6), (9, 8), (9, 30), (40, 14)):
        small = Params(
            round=0,
            clients=tuple(range(0, 3 * count, 3)),
            threshold=2,
            neighbors=degree,
            frac_bits=16,
            length=10,
            graph_seed=b"seed",
        )
        assert small.graph() == _harary(small), (count, degree)


def _harary(params: Params) -> dict[int, tuple[int, ...]]:
    """The graph built whole, edge by edge, as SecAgg+ defines it (and as this module did)."""
    ids = list(params.clients)
    n = len(ids)
    if params.neighbors >= n - 1:
        return {c: tuple(i for i in ids if i != c) for c in ids}
    order = ids[:]
    random.Random(params.graph_seed).shuffle(order)
    half, odd = divmod(params.neighbors, 2)
    links: dict[int, set[int]] = {c: set() for c in ids}
    for at, c in enumerate(order):
        others = [order[(at + step) % n] for step in range(1, half + 1)]
        for other in others + ([order[(at + n // 2) % n]] if odd else []):
            links[c].add(other)
            links[other].add(c)
    return {c: tuple(sorted(links[c] - {c})) for c in ids}


def test_the_cap_is_validated_and_a_secure_round_must_fit_it() -> None:
    with pytest.raises(ValueError, match=r"fed.secagg.max_clients=1 must be in 2\.\.65535"):
        SecAggConfig(max_clients=1)
    with pytest.raises(ValueError, match=r"fed\.min_fit_clients=20 is more than fed\.secagg\.max"):
        FedConfig(
            num_clients=30,
            min_fit_clients=20,
            secure_aggregation=True,
            secagg=SecAggConfig(max_clients=10),
        )
    FedConfig(num_clients=30, min_fit_clients=20, secagg=SecAggConfig(max_clients=10))
