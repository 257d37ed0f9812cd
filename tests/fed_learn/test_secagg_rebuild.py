"""What wrong revealed shares cost the coordinator's rebuild (fed_learn.secagg): a bounded number
of small bases, counted, whoever sends them; and the Lagrange bases it keeps stay within their
cache's bound."""

from __future__ import annotations

import random
import secrets

import numpy as np
import pytest
from Crypto.Protocol.SecretSharing import Shamir

from fed_learn import shamir
from fed_learn.secagg import RETRIES_PER_SECRET, RoundFailed
from fed_learn.shamir import leave_one_out

from .test_secagg import _params, _run


def test_leave_one_out_equals_the_library_on_every_subset() -> None:
    """Each secret `leave_one_out` gives (one basis of the whole window) is what
    Shamir.combine gives for the window less that share, a wrong share in it or not, for
    16-byte secrets and 32-byte keys (two side by side); the one left out was the wrong one."""
    rng = random.Random(11)
    for k, n in [(1, 2), (2, 3), (3, 5), (5, 9), (8, 12)]:
        for pieces in (1, 2):
            secret = [secrets.token_bytes(16) for _ in range(pieces)]
            splits = [Shamir.split(k, n, s) for s in secret]
            shares = [(splits[0][i][0], b"".join(sp[i][1] for sp in splits)) for i in range(n)]
            window = rng.sample(shares, k + 1)
            bad = rng.randrange(k + 1)
            index, share = window[bad]
            window[bad] = (index, bytes([share[0] ^ 1]) + share[1:])
            got = leave_one_out(window, pieces=pieces)
            for r in range(k + 1):
                rest = window[:r] + window[r + 1 :]
                expected = b"".join(
                    Shamir.combine([(i, s[16 * p : 16 * (p + 1)]) for i, s in rest])
                    for p in range(pieces)
                )
                assert got[r] == expected, (k, n, pieces, r)
            assert got[bad] == b"".join(secret)
    with pytest.raises(ValueError, match="must be distinct"):
        leave_one_out([shares[0], shares[0]], pieces=2)


LIARS = {
    "one": ({10}, True),
    "three_found_one_at_a_time": ({10, 17, 24}, True),
    "two_in_one_window": ({10, 11}, False),
}


@pytest.mark.parametrize(("liars", "goes_on"), LIARS.values(), ids=LIARS.keys())
def test_wrong_shares_cost_at_most_two_small_rebuilds_a_secret(
    monkeypatch, liars: set[int], goes_on: bool
) -> None:
    """16 clients, every one every other's neighbour, threshold 4, client 25 dropped (its key
    rebuilt); `liars` flip every share they reveal, their own seed's and the key's included.
    Counted: the Lagrange bases computed (each of at most threshold + 1 indices) and the
    rebuilds past the batch (at most RETRIES_PER_SECRET a secret). Before: a failed check
    left one share out at a time over all 15-16 shares, a basis of 14-15 indices per share
    left out (cubic in the round's degree), and two liars cost every one of them. Liars found
    one at a time are refused and the round goes on; two among one secret's first 5 shares
    fail it."""
    params = _params(16, threshold=4, neighbors=15, length=9)
    r = _run(params, before_input=frozenset({25}), before_reveal=frozenset(params.clients))
    survivors, dropped = r.server.unmask_request()
    for c in survivors:
        shares = r.clients[c].reveal(survivors, dropped)
        if c in liars:
            shares = {
                o: (kind, i, bytes(b ^ 0xFF for b in s)) for o, (kind, i, s) in shares.items()
            }
        r.server.add_reveal(c, shares)
    sizes: list[int] = []
    lagrange = shamir.lagrange

    def counted(indices: tuple[int, ...]) -> tuple[int, ...]:
        sizes.append(len(indices))
        return lagrange(indices)

    monkeypatch.setattr(shamir, "lagrange", counted)
    shamir.BASES.clear()
    try:
        total, weight, refused = r.server.aggregate()
    except RoundFailed as exc:
        assert not goes_on and "does not rebuild from its shares" in str(exc)
    else:
        assert goes_on
        assert {e.client for e in refused} == liars and len(refused) == len(liars)
        assert weight == sum(r.weights[c] for c in survivors)
        plain = sum(r.values[c] * r.weights[c] for c in survivors)
        assert np.abs(total - plain).max() < 1e-9
    assert sizes and max(sizes) <= params.threshold + 1
    assert 0 < r.server.retries <= RETRIES_PER_SECRET * (len(survivors) + len(dropped))
    # the batch's two index sets (the seeds', the dropped key's), then at most one a retry
    assert len(sizes) <= 2 + r.server.retries


def test_the_basis_cache_holds_at_most_its_bound_least_recently_used_out_first(
    monkeypatch,
) -> None:
    """A cache of 64 elements: 20 bases of 4 shares (8 elements each, indices and weights)
    leave the last 8; the first is computed again when asked; a basis larger than the whole
    cache is computed each time and never kept."""
    monkeypatch.setattr(shamir, "BASIS_CACHE_ELEMENTS", 64)
    computed: list[tuple[int, ...]] = []
    lagrange = shamir.lagrange

    def counted(indices: tuple[int, ...]) -> tuple[int, ...]:
        computed.append(indices)
        return lagrange(indices)

    monkeypatch.setattr(shamir, "lagrange", counted)
    shamir.BASES.clear()
    try:
        sets = [tuple(range(s, s + 4)) for s in range(1, 21)]
        weights = [shamir.basis(indices) for indices in sets]
        assert shamir.BASES.elements == 64
        assert shamir.basis(sets[-1]) == weights[-1] and computed == sets  # kept
        assert shamir.basis(sets[0]) == weights[0] and computed == [*sets, sets[0]]  # gone
        wide = tuple(range(1, 40))  # 78 elements
        shamir.basis(wide)
        shamir.basis(wide)
        assert computed.count(wide) == 2 and shamir.BASES.elements <= 64
    finally:
        shamir.BASES.clear()


def test_one_liar_cannot_pass_a_key_off_in_its_clamped_bits_to_blame_its_neighbour() -> None:
    """X25519 ignores 5 bits of a private key, so a dropped client's key rebuilt off in one of
    them still gives its public key. A liar that adds such an error, scaled by its own Lagrange
    weight in the window without an honest neighbour, made the candidate that leaves out that
    neighbour (and keeps the lie) pass the key check first: the honest holder was named. The
    check now also asks for a clamped key, as every client makes: the liar is the one named,
    and the sum is exact. (Found by a security review; without the clamped check: client 10.)"""
    params = _params(8, threshold=3, neighbors=7, length=9)
    dropped_client = 17
    r = _run(
        params, before_input=frozenset({dropped_client}), before_reveal=frozenset(params.clients)
    )
    survivors, dropped = r.server.unmask_request()
    assert dropped == [dropped_client]
    holders = r.server.holders(dropped_client)  # by share index; its own first (silent)
    victim, liar = holders[1], holders[2]
    rest = (3, 4, 5)  # the leave-one-out window's indices less the victim's (2)
    weight = dict(zip(rest, shamir.lagrange(rest), strict=True))[3]  # the liar's is index 3
    error = shamir._clmul(1 << 120, shamir._inverses([weight])[0])  # bit 0 of byte 0
    for client in survivors:
        shares = r.clients[client].reveal(survivors, dropped)
        if client == liar:
            kind, index, share = shares[dropped_client]
            lied = bytes(a ^ b for a, b in zip(share[:16], error.to_bytes(16, "big"), strict=True))
            shares[dropped_client] = (kind, index, lied + share[16:])
        r.server.add_reveal(client, shares)
    total, _, refused = r.server.aggregate()
    assert [wrong.client for wrong in refused] == [liar] != [victim]
    plain = sum(r.values[c] * r.weights[c] for c in survivors)
    assert np.abs(total - plain).max() < 1e-6
