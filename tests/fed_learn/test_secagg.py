"""Secure aggregation (fed_learn.secagg), the protocol alone: what the coordinator gets is the
sum and nothing else, dropouts at each step are recovered, and a peer's malformed message is
refused by name."""

from __future__ import annotations

import math
import random
import secrets
from dataclasses import dataclass

import numpy as np
import pytest
from Crypto.Protocol.SecretSharing import Shamir
from scipy import stats

from fed_learn.fixed_point import dequantize, frac_bits_for, quantize
from fed_learn.secagg import (
    BOX_BYTES,
    KEY,
    SEED,
    Client,
    Params,
    Refused,
    RoundFailed,
    Server,
)
from fed_learn.secure import check_aggregate
from fed_learn.shamir import combine, combine_many
from labtools.attacks.secure_rounds import reindexed_box


def _params(n: int = 8, *, threshold: int = 3, neighbors: int = 4, length: int = 257) -> Params:
    return Params(
        round=7,
        clients=tuple(range(10, 10 + n)),
        threshold=threshold,
        neighbors=neighbors,
        frac_bits=frac_bits_for(n, weight_cap=64, value_bound=4.0),
        length=length,
        graph_seed=b"test",
    )


@dataclass
class Round:
    params: Params
    clients: dict[int, Client]
    server: Server
    values: dict[int, np.ndarray]
    weights: dict[int, int]


def relay(server: Server, client: int) -> tuple[dict[int, bytes], dict[int, tuple[int, ...]]]:
    """Step 1's answer to `client`: its boxes, and each sender's holder list beside them."""
    boxes = server.boxes_for(client)
    return boxes, {sender: server.holders(sender) for sender in boxes}


def _run(
    params: Params,
    *,
    before_shares: frozenset[int] = frozenset(),
    before_input: frozenset[int] = frozenset(),
    before_reveal: frozenset[int] = frozenset(),
    seed: int = 0,
) -> Round:
    """One round, clients dropping at the step named (they send nothing from then on)."""
    rng = np.random.default_rng(seed)
    clients = {c: Client(c, params) for c in params.clients}
    server = Server(params)
    for c, client in clients.items():
        server.add_keys(c, *client.public_keys())
    for c, client in clients.items():
        if c not in before_shares:
            server.add_shares(c, *client.share(server.keys_for(c)))
    for c, client in clients.items():
        if c not in before_shares:
            assert client.receive(*relay(server, c)) == []
    values = {c: rng.uniform(-4, 4, params.length - 1) for c in params.clients}
    weights = {c: int(rng.integers(1, 65)) for c in params.clients}
    for c, client in clients.items():
        if c not in before_shares | before_input:
            server.add_input(c, client.masked_input(values[c], weights[c]))
    survivors, dropped = server.unmask_request()
    for c, client in clients.items():
        if c in server.inputs and c not in before_reveal:
            server.add_reveal(c, client.reveal(survivors, dropped))
    return Round(params, clients, server, values, weights)


def shared_round(params: Params) -> tuple[dict[int, Client], Server]:
    """A round's clients and coordinator once every client has shared its keys (no dropouts):
    ready for masked inputs."""
    clients = {c: Client(c, params) for c in params.clients}
    server = Server(params)
    for c, client in clients.items():
        server.add_keys(c, *client.public_keys())
    for c, client in clients.items():
        server.add_shares(c, *client.share(server.keys_for(c)))
    for c, client in clients.items():
        assert client.receive(*relay(server, c)) == []
    return clients, server


def _check_sum(r: Round) -> None:
    total, weight, refused = r.server.aggregate()
    survivors = sorted(r.server.inputs)
    assert refused == []
    assert weight == sum(r.weights[c] for c in survivors)  # the weights' sum: exact
    bits = r.params.frac_bits
    # exactly the sum of what each survivor quantized (the masks cancel to the bit) ...
    exact = np.zeros(r.params.length - 1, dtype=np.uint64)
    for c in survivors:
        exact += quantize(r.values[c] * r.weights[c], bits)
    np.testing.assert_array_equal(total, dequantize(exact, bits))
    # ... hence the plain weighted sum within half a quantization step per client
    plain = sum(r.values[c] * r.weights[c] for c in survivors)
    step = 2.0**-bits
    assert np.abs(total - plain).max() <= len(survivors) * step / 2 + 1e-12 * np.abs(plain).max()


@pytest.mark.parametrize("neighbors", [4, 7])  # SecAgg+'s sparse graph; everyone (SecAgg)
def test_the_secure_sum_is_the_weighted_sum(neighbors: int) -> None:
    _check_sum(_run(_params(neighbors=neighbors)))


def test_a_client_dropping_before_its_masked_input_is_recovered() -> None:
    """Its pairwise masks are rebuilt from its `s` key's shares and removed."""
    r = _run(_params(), before_input=frozenset({11, 14}))
    assert sorted(r.server.unmask_request()[1]) == [11, 14]
    _check_sum(r)


def test_a_client_dropping_after_its_masked_input_still_counts() -> None:
    """Its self-mask is rebuilt from its neighbours' shares; its input is in the sum."""
    r = _run(_params(), before_reveal=frozenset({12}))
    assert 12 in r.server.inputs
    _check_sum(r)


def test_a_client_that_never_shared_is_left_out_cleanly() -> None:
    r = _run(_params(), before_shares=frozenset({13}))
    assert 13 not in r.server.inputs
    _check_sum(r)


def test_all_three_kinds_of_dropout_in_one_round() -> None:
    r = _run(
        _params(10, threshold=3, neighbors=6),
        before_shares=frozenset({10}),
        before_input=frozenset({15}),
        before_reveal=frozenset({17}),
    )
    _check_sum(r)


def test_fewer_survivors_than_the_threshold_fail_the_round() -> None:
    params = _params(5, threshold=4, neighbors=4)
    with pytest.raises(RoundFailed, match="3 masked inputs; the threshold is 4"):
        _run(params, before_input=frozenset({10, 11}))


def test_too_few_shares_of_one_client_fail_the_round() -> None:
    # 6 clients, 2 neighbours each: a dropped client's key lives with 2 others and itself
    params = _params(6, threshold=3, neighbors=2)
    r = _run(params, before_input=frozenset({10}), before_reveal=frozenset(params.neighbours(10)))
    with pytest.raises(RoundFailed, match=r"1 shares of client \d+'s seed; the threshold is 3"):
        r.server.aggregate()


def test_a_masked_input_is_independent_of_what_it_hides() -> None:
    """The same client's masked input for two very different updates, over many rounds:
    uncorrelated with the update, and its bytes uniform."""
    n, length, rounds = 4, 65, 60
    params = Params(
        round=1, clients=(1, 2, 3, 4), threshold=2, neighbors=3, frac_bits=20, length=length
    )
    hidden_small, hidden_large = np.zeros(length - 1), np.full(length - 1, 1000.0)
    masked = []
    hidden = []
    for i in range(rounds):
        values = hidden_small if i % 2 else hidden_large
        clients, _ = shared_round(params)
        masked.append(clients[1].masked_input(values, 3)[:-1])
        hidden.append(quantize(values * 3, params.frac_bits))
    y = np.concatenate(masked).view(np.int64).astype(np.float64)
    x = np.concatenate(hidden).view(np.int64).astype(np.float64)
    r = np.corrcoef(x, y)[0, 1]
    assert abs(r) < 4 / math.sqrt(len(x)), r  # within noise of zero correlation
    data = np.concatenate(masked).view(np.uint8)
    counts = np.bincount(data, minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-4  # bytes look uniform
    assert n == len(params.clients)


# ------------------------------------------------------------------ malformed peers


def _after_shares(params: Params | None = None) -> tuple[Params, dict[int, Client], Server]:
    params = params or _params()
    clients = {c: Client(c, params) for c in params.clients}
    server = Server(params)
    for c, client in clients.items():
        server.add_keys(c, *client.public_keys())
    return params, clients, server


def test_malformed_keys_are_refused_by_name() -> None:
    _, _, server = _after_shares()
    with pytest.raises(Refused, match="client 99: not a client of this round"):
        server.add_keys(99, bytes(32), bytes(range(32)))
    with pytest.raises(Refused, match="client 10: its c public key must be 32 bytes"):
        server.add_keys(10, b"short", bytes(32))
    with pytest.raises(Refused, match="client 10: the same key for both"):
        server.add_keys(10, bytes(range(32)), bytes(range(32)))


def test_a_low_order_public_key_is_refused_by_name() -> None:
    params, clients, server = _after_shares()
    neighbour = params.neighbours(10)[0]
    keys = server.keys_for(10)
    keys[neighbour] = (bytes(32), bytes(32))  # the all-zero point: a shared secret of zeros
    with pytest.raises(Refused, match=f"client {neighbour}: unusable public key"):
        clients[10].share(keys)


def test_malformed_and_misaddressed_shares_are_refused_by_name() -> None:
    params, clients, server = _after_shares()
    boxes, commitment = clients[10].share(server.keys_for(10))
    with pytest.raises(Refused, match="client 10: a seed commitment must be 32 bytes"):
        server.add_shares(10, boxes, b"x")
    with pytest.raises(Refused, match="client 10: share boxes for"):
        server.add_shares(10, dict(list(boxes.items())[1:]), commitment)  # one missing
    with pytest.raises(Refused, match=f"client 10: a share box must be {BOX_BYTES} bytes"):
        server.add_shares(10, {k: b[:-1] for k, b in boxes.items()}, commitment)
    server.add_shares(10, boxes, commitment)

    recipient = params.neighbours(10)[0]
    clients[recipient].share(server.keys_for(recipient))
    box = boxes[recipient]
    tampered = bytes([box[0] ^ 1]) + box[1:]
    holders = {10: server.holders(10)}
    refused = clients[recipient].receive({10: tampered}, holders)
    assert [str(e) for e in refused] == [
        "client 10: a share box that does not open (wrong key or altered)"
    ]
    other = next(c for c in params.neighbours(10) if c != recipient)
    clients[other].share(server.keys_for(other))
    # a box for `recipient` handed to `other`: it does not open there
    assert "does not open" in str(clients[other].receive({10: box}, holders)[0])
    stranger = next(c for c in params.clients if c not in (10, *params.neighbours(10)))
    clients[stranger].share(server.keys_for(stranger))
    assert "not its neighbour" in str(clients[stranger].receive({10: box}, holders)[0])


def test_malformed_masked_inputs_and_reveals_are_refused_by_name() -> None:
    r = _run(_params(), before_reveal=frozenset(_params().clients))  # all inputs, no reveals
    server, length = r.server, r.params.length
    with pytest.raises(Refused, match=f"client 10: a masked input must be {length} uint64s"):
        server.add_input(10, np.zeros(length, dtype=np.int64))
    with pytest.raises(Refused, match="client 10: a masked input must be"):
        server.add_input(10, np.zeros(length + 1, dtype=np.uint64))
    survivors, dropped = server.unmask_request()
    good = r.clients[10].reveal(survivors, dropped)
    owner = next(iter(good))
    _, index, share = good[owner]
    for bad, message in [
        ({owner: (KEY, index, share + share)}, f"a 'key' share of client {owner}, asked for seed"),
        ({owner: (SEED, 0, share)}, f"share index 0 of client {owner}; it holds {index}"),
        # another holder's index (two shares at one point would break the interpolation)
        ({owner: (SEED, index % 3 + 1, share)}, f"share index {index % 3 + 1} of client"),
        ({owner: (SEED, True, share)}, f"share index True of client {owner}"),
        ({owner: (SEED, index, share[:-1])}, "a seed share must be 16 bytes"),
        ({owner: "nonsense"}, r"a revealed share is \(kind, index, bytes\)"),
    ]:
        with pytest.raises(Refused, match=f"client 10: {message}"):
            server.add_reveal(10, bad)  # type: ignore[arg-type]
    stranger = next(c for c in r.params.clients if c not in (10, *r.params.neighbours(10)))
    with pytest.raises(Refused, match=f"client 10: a share of client {stranger}"):
        server.add_reveal(10, {stranger: (SEED, 1, bytes(16))})


def test_a_wrong_share_is_found_and_its_revealer_refused_the_round_goes_on() -> None:
    """A well-formed but false share: the seed's commitment catches it; with shares to spare
    the coordinator finds whose it was, refuses that client and still unmasks the sum."""
    params = _params(8, threshold=3, neighbors=6)
    r = _run(params, before_reveal=frozenset(params.clients))
    survivors, dropped = r.server.unmask_request()
    liar = survivors[0]
    for c in survivors:
        shares = r.clients[c].reveal(survivors, dropped)
        if c == liar:
            victim = next(o for o in shares if o != c)
            kind, index, share = shares[victim]
            shares[victim] = (kind, index, bytes(b ^ 0xFF for b in share))
        r.server.add_reveal(c, shares)
    total, weight, refused = r.server.aggregate()
    assert [e.client for e in refused] == [liar]
    assert weight == sum(r.weights.values())
    plain = sum(r.values[c] * r.weights[c] for c in survivors)
    assert np.abs(total - plain).max() < 1e-9


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_wrong_share_index_is_refused_by_its_receiver_who_is_not_blamed(
    monkeypatch, checked: bool
) -> None:
    """A dealer writes another holder's index (in range) into one neighbour's box. Checked
    against the relayed holder list, the receiver refuses that box naming the dealer, holds
    no share of it, and the round unmasks with no one refused; without the check (control)
    the receiver reveals the share and the coordinator refuses it as a liar."""
    if not checked:
        monkeypatch.setattr(Client, "_check_index", lambda self, sender, index, listed: None)
    params, clients, server = _after_shares()
    dealer, victim, other = 10, *params.neighbours(10)[:2]
    for c, client in clients.items():
        boxes, commitment = client.share(server.keys_for(c))
        if c == dealer:
            wrong = server.share_index(dealer, other)
            boxes[victim] = reindexed_box(client, victim, boxes[victim], wrong)
        server.add_shares(c, boxes, commitment)
    right = server.share_index(dealer, victim)
    lie = f"client {dealer}: share index {wrong} in its box; its holder list gives client"
    for c, client in clients.items():
        refused = [str(e) for e in client.receive(*relay(server, c))]
        assert refused == ([f"{lie} {victim} index {right}"] if checked and c == victim else [])
    for c, client in clients.items():
        server.add_input(c, client.masked_input(np.zeros(params.length - 1), 1))
    survivors, dropped = server.unmask_request()
    if not checked:
        with pytest.raises(Refused, match=f"client {victim}: share index {wrong} of client"):
            server.add_reveal(victim, clients[victim].reveal(survivors, dropped))
        return
    for c, client in clients.items():
        server.add_reveal(c, client.reveal(survivors, dropped))
    total, weight, unmasked_refused = server.aggregate()
    assert unmasked_refused == [] and weight == len(params.clients)
    np.testing.assert_array_equal(total, np.zeros(params.length - 1))


REFUTED_HOLDERS = {  # client 10's holder list as relayed to client 11 (8 clients, threshold 3)
    "missing": None,
    "empty": [],
    "sender_not_first": [11, 10, 12],
    "unsorted": [10, 12, 11],
    "twice": [10, 11, 11],
    "stranger": [10, 11, 99],
    "not_an_id": [10, "11", 12],
    "short": [10, 11],
    "omits_one_with_keys": [10, *range(11, 17)],  # 17 is on client 11's roster
}


@pytest.mark.parametrize("listed", REFUTED_HOLDERS.values(), ids=REFUTED_HOLDERS.keys())
def test_a_holder_list_the_graph_refutes_is_refused_naming_the_sender(listed) -> None:
    """The receiver checks the relayed holder list against the round's public graph and its
    own roster before it trusts the index it gives."""
    params = _params(8, threshold=3, neighbors=7)  # everyone is everyone's neighbour
    clients = {c: Client(c, params) for c in params.clients}
    server = Server(params)
    for c, client in clients.items():
        server.add_keys(c, *client.public_keys())
    boxes, _ = clients[10].share(server.keys_for(10))
    clients[11].share(server.keys_for(11))
    holders = {} if listed is None else {10: listed}
    [refused] = clients[11].receive({10: boxes[11]}, holders)
    assert refused.client == 10 and "holder list" in str(refused)
    assert clients[11].receive({10: boxes[11]}, {10: server.holders(10)}) == []


def test_an_honest_client_never_reveals_both_shares_of_one_client() -> None:
    r = _run(_params(), before_reveal=frozenset(_params().clients))
    client = r.clients[10]
    survivors, dropped = r.server.unmask_request()
    client.reveal(survivors, dropped)
    neighbour = next(c for c in client.sharers if c in survivors)
    # a coordinator now claiming that neighbour dropped asks for its key as well
    with pytest.raises(RoundFailed, match=f"both kinds of share of client {neighbour}"):
        client.reveal([c for c in survivors if c != neighbour], [*dropped, neighbour])
    with pytest.raises(RoundFailed, match="listed as survived and dropped"):
        client.reveal(survivors, [survivors[0]])


def test_relayed_keys_that_are_not_its_own_are_refused() -> None:
    params, clients, server = _after_shares()
    keys = server.keys_for(10)
    keys[10] = keys[params.neighbours(10)[0]]
    with pytest.raises(Refused, match="client 10: the relayed keys are not"):
        clients[10].share(keys)


def test_round_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match=r"threshold=9 must be in 1\.\.5"):
        Params(round=0, clients=(1, 2, 3, 4, 5), threshold=9, neighbors=4, frac_bits=8, length=3)
    with pytest.raises(ValueError, match="distinct sorted"):
        Params(round=0, clients=(2, 1), threshold=1, neighbors=1, frac_bits=8, length=3)
    graph = _params(20, neighbors=5).graph()
    assert all(len(v) >= 5 for v in graph.values())  # a Harary graph: degree >= k
    assert all(a in graph[b] for a, vs in graph.items() for b in vs)  # symmetric


def test_combine_equals_the_library_and_refuses_duplicate_indices() -> None:
    """`combine` (the Lagrange basis kept per index set) gives Shamir.combine's bytes for any
    subset of shares, and refuses two shares at one index instead of dividing by zero."""
    rng = random.Random(3)
    for k, n in [(1, 1), (2, 3), (5, 9), (8, 15)]:
        secret = secrets.token_bytes(16)
        shares = Shamir.split(k, n, secret)
        for _ in range(6):
            subset = rng.sample(shares, k)
            assert combine(subset) == Shamir.combine(subset) == secret
    with pytest.raises(ValueError, match="must be distinct"):
        combine([shares[0], shares[0]])


def test_a_batch_of_secrets_equals_the_library_on_random_subsets() -> None:
    """`combine_many` (every secret's field products in one numpy batch) returns, for groups
    of different sizes and index sets, what `Shamir.combine` returns for each."""
    rng = random.Random(5)
    groups, expected = [], []
    for _ in range(40):
        k = rng.randint(1, 12)
        n = rng.randint(k, 20)
        secret = secrets.token_bytes(16)
        subset = rng.sample(Shamir.split(k, n, secret), rng.randint(k, n))  # k or more
        groups.append(subset)
        expected.append(Shamir.combine(subset))
        assert expected[-1] == secret
    assert combine_many(groups) == expected
    assert combine_many([]) == []


def test_check_aggregate_measures_the_l2_norm_and_refuses_a_sum_over_its_bound() -> None:
    """The unmasked sum's norm (summed without BLAS) is numpy's L2 norm; a sum whose norm is
    over the clip x the weights (+ rounding room) fails the round, one that is not finite too."""
    total = np.random.default_rng(3).standard_normal(5000)
    weights = {1: 2, 2: 3}
    norm = float(np.linalg.norm(total))
    bound = norm / 5 * 1.001  # just over: the weights sum to 5

    def check(values: np.ndarray, weight_sum: int, bound: float) -> float:
        return check_aggregate(
            values, weight_sum, bound=bound, weights=weights, noise_std=0.0, frac_bits=24
        )

    assert check(total, 5, bound) == pytest.approx(norm, rel=1e-12)
    with pytest.raises(RoundFailed, match=r"L2 norm .* over its bound"):
        check(total, 5, norm / 5 * 0.999)
    with pytest.raises(RoundFailed, match="not finite"):
        check(np.append(total, np.inf), 5, bound)
    with pytest.raises(RoundFailed, match="masked weights sum to 4"):
        check(total, 4, bound)
