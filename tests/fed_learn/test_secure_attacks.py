# ruff: noqa: F811 (the imported fixtures are the tests' arguments)
"""Issue 48's scripted attacks on a secure round, each beside its control arm: the same script
with the check that stops it taken out (monkeypatched), so a test passes only if the attack is
real and that check is what stops it.

A secret holder runs the honest protocol and tampers with one message: an offset on its masked
input, a replay of an earlier one, a weight of 2^40, a short input, junk shares, one key for
both purposes. Attributable attacks are refused by name (the round goes on without the
attacker, who is excluded from later rounds); the offset is not attributable, and the check on
the unmasked sum refuses the round whole. A wrong share index in a neighbour's box is refused
by that neighbour, naming the dealer, and costs the neighbour nothing."""

from __future__ import annotations

import base64
import logging
import math
from typing import Any

import numpy as np
import pytest
import torch

from fed_learn import secagg, secure
from fed_learn.config import SecAggConfig
from fed_learn.coordinator import Coordinator
from fed_learn.protocol import FedMsg
from labtools.attacks import secure_rounds as attacks
from labtools.attacks.secure_rounds import (
    HONEST,
    SecurePlayer,
    State,
    heavy_masked,
    heavy_result,
    moved,
    offset_masked,
    reindexed_box,
    replay,
    tampered,
)

from .test_secure_rounds import (  # noqa: F401 (fixtures: pytest finds them by name)
    _send_then_leave,
    _until,
    assert_adapter,
    expected_mean,
    federation,
    honest,
    in_join_order,
    secure_federation,
)


def players_with(step: Any) -> list[SecurePlayer]:
    """labtools' two honest clients and the attacker, which joins last (the highest id): here
    once the others were welcomed, not after its 0.3 s join delay, which a busy machine may
    outlast."""
    return in_join_order(attacks.players_with(step))


def named(coordinator: Coordinator) -> set[int]:
    return set(coordinator.excluded)


# ------------------------------------------------------------------ not attributable


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_an_offset_on_a_masked_input_fails_the_round_whole(
    secure_federation, monkeypatch, caplog, checked: bool
) -> None:
    """2^58 on every entry: past the bound on the sum (fed.max_update_norm x the weights),
    so the round is refused in one line giving both; without that check the adapter moves
    past fed.max_update_norm (issue 48 measured 1.996e5 against its bound)."""
    if not checked:
        monkeypatch.setattr(secure, "check_aggregate", lambda *a, **k: 0.0)
    with caplog.at_level(logging.WARNING):
        coordinator, initial, [record] = secure_federation(
            players_with(tampered(masked=offset_masked))
        )
    bound = coordinator.fed.max_update_norm
    if checked:
        assert_adapter(coordinator, initial)  # refused whole: the previous adapter kept
        [line] = [r.getMessage() for r in caplog.records if "over its bound" in r.getMessage()]
        assert "secure aggregation failed: the sum's L2 norm" in line
        assert record["refused"] == 0 and not named(coordinator)  # no one to name
    else:
        assert moved(coordinator, initial) > bound


def _in_range(task: dict[str, Any], masked: np.ndarray) -> np.ndarray:
    """An offset on every entry that puts the sum's norm at 0.9 of its bound (the attacker
    reads the bound, fixed point and length from its task; weights 3 x 10)."""
    params = task["secure"]
    entries = params["length"] - 1
    per_entry = 0.9 * params["bound"] * 30 / math.sqrt(entries)
    out = masked.copy()
    out[:-1] += np.uint64(round(per_entry * 2 ** params["frac_bits"]))
    return out


def test_poison_inside_the_aggregate_bound_moves_the_mean_by_up_to_max_update_norm(
    secure_federation,
) -> None:
    """What no check attributes: one client's offset within the sum's bound is taken, and
    moves the mean by up to fed.max_update_norm (0.9 of it here), three times the most its
    own clipped, weighted update could (bound x 10 / 30)."""
    coordinator, initial, [record] = secure_federation(players_with(tampered(masked=_in_range)))
    bound = coordinator.fed.max_update_norm
    distance = moved(coordinator, initial)
    print(f"in-range poison moved the adapter by L2 {distance:.6g} (bound {bound:g})")
    assert record["clients"] == 3 and record["refused"] == 0
    assert 2.5 * bound * 10 / 30 < distance <= bound


# ------------------------------------------------------------------ attributable


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_replayed_masked_input_is_refused_by_name(
    secure_federation, monkeypatch, checked: bool
) -> None:
    if not checked:
        monkeypatch.setattr(secure.InputDigests, "admit", lambda *a, **k: None)
    coordinator, initial, rounds = secure_federation(players_with(replay()), rounds=2)
    after_first = expected_mean(initial, [*HONEST, 0.03], [10] * 3)
    if checked:  # its masks taken out as a dropout's: the honest two count
        assert_adapter(coordinator, expected_mean(after_first, list(HONEST), [10, 10]))
        assert rounds[1]["refused"] == 1 and len(named(coordinator)) == 1
    else:  # unmasked with round 2's masks, round 1's input is noise: a veto, no one named
        assert_adapter(coordinator, after_first)
        assert rounds[1]["refused"] == 0 and not named(coordinator)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_weight_of_2_to_40_is_refused_by_name_and_excluded(
    secure_federation, monkeypatch, checked: bool
) -> None:
    """Its weight travels in clear: 2^40 over the 10 it declared is refused before unmasking,
    and it takes no part in round 2. Without that check the round divides by 2^40 and the
    honest clients' updates vanish, silently."""
    if not checked:
        monkeypatch.setattr(secure, "check_weight", lambda client, value, declared: value)
    step = tampered(result=heavy_result, masked=heavy_masked)
    coordinator, initial, rounds = secure_federation(players_with(step), rounds=2)
    if checked:
        once = expected_mean(initial, list(HONEST), [10, 10])
        assert_adapter(coordinator, expected_mean(once, list(HONEST), [10, 10]))
        assert [(r["clients"], r["refused"]) for r in rounds] == [(2, 1), (2, 0)]
        assert rounds[1]["failures"] == 0  # round 2 did not even ask it
        assert len(named(coordinator)) == 1
    else:
        honest_move = moved_by(initial, expected_mean(initial, list(HONEST), [10, 10]))
        assert moved(coordinator, initial) < 1e-6 * honest_move
        assert [r["refused"] for r in rounds] == [0, 0] and not named(coordinator)


def moved_by(initial: State, expected: State) -> float:
    diff = [(expected[n].double() - initial[n].double()).reshape(-1) for n in initial]
    return float(torch.cat(diff).norm())


def _short(task: dict[str, Any], masked: np.ndarray) -> np.ndarray:
    return masked[:-1].copy()


def _store_unchecked(self: secagg.Server, client: int, masked: np.ndarray) -> None:
    self.inputs[client] = masked


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_short_masked_input_is_refused_by_name(
    secure_federation, monkeypatch, checked: bool
) -> None:
    """Without the length check a short input reaches the unmasking and ends the run."""
    if not checked:
        monkeypatch.setattr(secagg.Server, "add_input", _store_unchecked)
        with pytest.raises(ValueError, match="broadcast"):
            secure_federation(players_with(tampered(masked=_short)))
        return
    coordinator, initial, [record] = secure_federation(players_with(tampered(masked=_short)))
    assert_adapter(coordinator, expected_mean(initial, list(HONEST), [10, 10]))
    assert record["refused"] == 1 and len(named(coordinator)) == 1


def _junk(conn, task, payload, send) -> None:
    for share in payload["shares"].values():
        raw = bytearray(base64.b64decode(share[2]))
        raw[0] ^= 0xFF
        share[2] = base64.b64encode(bytes(raw)).decode()
    send[0](FedMsg.SA_REVEAL, payload)


def _rebuild_unchecked(self: secagg.Server, owner: int, kind: str, check: object):
    shares = sorted(self._shares_of(owner, kind), key=lambda got: got[1][0])
    return secagg._combine([s for _, s in shares[: self.params.threshold]], kind), []


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_junk_shares_are_traced_to_their_sender(
    secure_federation, monkeypatch, checked: bool
) -> None:
    """The junk-share sender joins first, so its shares are among those a rebuild uses; the
    rebuilt seed is checked against its commitment (without that, the wrong seed leaves a
    mask in the sum and the round is lost with no one named). The sender is found, its shares
    left out of the round and the round counts it refused, but it is not excluded from the run:
    a leave-one-out check suspects, it does not prove (two revealers colluding can make an
    honest one the suspect), and a run-wide exclusion on suspicion would let them."""
    if not checked:
        monkeypatch.setattr(secagg.Server, "_rebuild", _rebuild_unchecked)
    liar = SecurePlayer(0.03, step=_until(FedMsg.SA_REVEAL, then=_junk), name="attacker")
    players = in_join_order([liar, *(SecurePlayer(o) for o in HONEST)])
    coordinator, initial, [record] = secure_federation(players)
    if checked:
        assert_adapter(coordinator, expected_mean(initial, [*HONEST, 0.03], [10] * 3))
        assert record["refused"] == 1 and not named(coordinator)
    else:
        assert_adapter(coordinator, initial)
        assert record["refused"] == 0 and not named(coordinator)


def _one_key(task: dict[str, Any]) -> dict[str, Any]:
    key = base64.b64encode(bytes(range(1, 33))).decode()
    return {"task": task["task"], "c": key, "s": key}


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_one_key_for_both_purposes_is_refused_by_name(
    secure_federation, monkeypatch, checked: bool
) -> None:
    """The attacker advertises one key as both of its keys, then goes silent; without the
    check it is taken and nothing names it (the round waits out the share step for it)."""
    if not checked:
        monkeypatch.setattr(
            secagg.Server,
            "add_keys",
            lambda self, client, c, s: self.keys.__setitem__(client, (c, s)),
        )
    step = _send_then_leave(FedMsg.SA_KEYS, _one_key)
    coordinator, initial, [record] = secure_federation(players_with(step))
    assert_adapter(coordinator, expected_mean(initial, list(HONEST), [10, 10]))
    assert record["refused"] == (1 if checked else 0)
    assert len(named(coordinator)) == (1 if checked else 0)


def _wrong_index_dealer(monkeypatch, dealer: SecurePlayer) -> None:
    """`dealer` runs the honest protocol but seals, in the box of its lowest-id neighbour,
    the index of its highest-id one (itself first, then by id: len(boxes) + 1): in range, and
    another holder's. With one neighbour left it has no other holder's index to write."""
    honest_share = secagg.Client.share

    def share(self: secagg.Client, keys: Any) -> tuple[dict[int, bytes], bytes]:
        boxes, commitment = honest_share(self, keys)
        if self.client_id == dealer.client_id and len(boxes) > 1:
            victim = min(boxes)
            boxes[victim] = reindexed_box(self, victim, boxes[victim], len(boxes) + 1)
        return boxes, commitment

    monkeypatch.setattr(secagg.Client, "share", share)


@pytest.mark.parametrize("checked", [True, False], ids=["checked", "control"])
def test_a_wrong_share_index_costs_the_dealer_not_its_honest_neighbour(
    secure_federation, monkeypatch, caplog, checked: bool
) -> None:
    """A secret holder writes a wrong but in-range share index in an honest neighbour's box.
    The neighbour checks it against the holder list the coordinator relays, refuses the box
    naming the dealer and reveals no share of it: no one is refused, and the neighbour takes
    part in round 2. Without that check (control) its reveal is refused as a lie, and the
    honest neighbour is named and excluded."""
    if not checked:
        monkeypatch.setattr(secagg.Client, "_check_index", lambda *a: None)
    players = players_with(honest)
    _wrong_index_dealer(monkeypatch, players[-1])
    with caplog.at_level(logging.WARNING):
        coordinator, initial, rounds = secure_federation(players, rounds=2)
    # the dealer's lowest-id neighbour (ids go by the order the players joined: a race)
    victim = min(p.client_id for p in players[:-1])
    if checked:
        once = expected_mean(initial, [*HONEST, 0.03], [10] * 3)
        assert_adapter(coordinator, expected_mean(once, [*HONEST, 0.03], [10] * 3))
        assert [(r["clients"], r["refused"]) for r in rounds] == [(3, 0), (3, 0)]
        assert not named(coordinator)
        blamed = [r.getMessage() for r in caplog.records if "in its box" in r.getMessage()]
        assert len(blamed) == 2  # once a round, by the victim, naming the dealer
        assert all(f"client {players[-1].client_id}: share index 3" in line for line in blamed)
    else:
        assert named(coordinator) == {victim}
        assert [r["refused"] for r in rounds] == [1, 0] and rounds[1]["clients"] == 2


# ------------------------------------------------------------------ non-finite training


def _silent_nan(conn, task, state, me) -> None:
    """The honest protocol up to the masked input, which it never sends (no SKIP either)."""
    _until(FedMsg.RESULT)(conn, task, state, me)


@pytest.mark.parametrize("says_so", [True, False], ids=["skip", "control"])
def test_a_client_whose_training_went_non_finite_says_so_and_is_not_waited_for(
    secure_federation, caplog, says_so: bool
) -> None:
    """It sends SKIP in clear and sits the round out: the round does not wait for it (its
    input timeout is an hour here: the test could not end otherwise). The control goes silent
    instead, and its round waits out a short input timeout for it."""
    nan_client = SecurePlayer(math.nan, 10, name="nan") if says_so else None
    silent = SecurePlayer(0.03, 10, step=_silent_nan, name="silent")
    players = [*(SecurePlayer(o, 10) for o in HONEST), nan_client or silent]
    timeout_s = 3600.0 if says_so else 5.0
    with caplog.at_level(logging.INFO):
        coordinator, initial, [record] = secure_federation(
            players, round_timeout_s=timeout_s, secagg=SecAggConfig(step_timeout_s=30.0)
        )
    assert_adapter(coordinator, expected_mean(initial, list(HONEST), [10, 10]))
    assert (record["clients"], record["failures"], record["refused"]) == (2, 1, 0)
    sat_out = [r for r in caplog.records if "sits out: non-finite update" in r.getMessage()]
    assert len(sat_out) == (1 if says_so else 0)
    assert not named(coordinator)
