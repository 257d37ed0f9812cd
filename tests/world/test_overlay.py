"""world.overlay's control plane checks every field a peer or the hub sends before it turns
into a `wg` or `ip` argument; the overlay itself runs in tests/multihost/test_overlay.py."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from lab.config import ClusterConfig, OverlayConfig
from tests.clocks import HANG_GUARD_S
from world.overlay import (
    Interface,
    OverlayError,
    _check_join,
    _check_roster,
    _host_of,
    check_public_key,
    preshared_key,
)

KEY = base64.b64encode(bytes(range(32))).decode()


def roster(**changes: Any) -> dict[str, Any]:
    entry = {"name": "hub", "public_key": KEY, "endpoint": "10.213.0.1:51820",
             "address": "10.213.128.1"}  # fmt: skip
    base: dict[str, Any] = {"address": "10.213.128.2", "prefix": 24, "peers": [entry]}
    peer_changes = changes.pop("peer", {})
    entry.update(peer_changes)
    base.update(changes)
    return base


def test_a_good_public_key_passes() -> None:
    assert check_public_key(KEY) == KEY


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("not a string", 12345),
        ("too short", KEY[:-4]),
        ("not base64", "!" * 44),
        ("an option for wg", "--private-key=/etc/shadow" + "A" * 19),
        ("33 bytes", base64.b64encode(bytes(33)).decode()[:44]),
    ],
)
def test_a_bad_public_key_is_refused(name: str, value: Any) -> None:
    with pytest.raises(ValueError):
        check_public_key(value)


@pytest.mark.parametrize(
    ("name", "payload"),
    [
        ("no name", {"public_key": KEY, "wg_port": 51820}),
        ("name with a newline", {"name": "a\nb", "public_key": KEY, "wg_port": 51820}),
        ("name too long", {"name": "n" * 33, "public_key": KEY, "wg_port": 51820}),
        ("port zero", {"name": "p", "public_key": KEY, "wg_port": 0}),
        ("port out of range", {"name": "p", "public_key": KEY, "wg_port": 70000}),
        ("port a bool", {"name": "p", "public_key": KEY, "wg_port": True}),
        ("port a string", {"name": "p", "public_key": KEY, "wg_port": "51820"}),
        ("bad key", {"name": "p", "public_key": "x", "wg_port": 51820}),
    ],
)
def test_a_malformed_join_is_refused(name: str, payload: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        _check_join(payload)


def test_the_endpoint_is_the_address_the_hub_saw_never_a_name() -> None:
    assert _host_of("10.213.0.2:40000") == "10.213.0.2"
    assert _host_of("[fe80::1]:40000") == "fe80::1"
    with pytest.raises(ValueError):
        _host_of("evil.example:40000")


def test_a_good_roster_gives_our_address_and_the_peers() -> None:
    address, prefix, peers = _check_roster(roster())
    assert (address, prefix) == ("10.213.128.2", 24)
    assert [(p.public_key, p.endpoint, p.address) for p in peers] == [
        (KEY, "10.213.0.1:51820", "10.213.128.1")
    ]


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("no peers", {"peers": []}),
        ("address not an address", {"address": "10.213.128.2/24; rm -rf /"}),
        ("prefix missing", {"prefix": None}),
        ("prefix too wide", {"prefix": 0}),
        ("endpoint without a port", {"peer": {"endpoint": "10.213.0.1"}}),
        ("endpoint a host name", {"peer": {"endpoint": "evil.example:51820"}}),
        ("peer address not IPv4", {"peer": {"address": "0.0.0.0/0"}}),
        ("peer key bad", {"peer": {"public_key": "--help"}}),
        ("peers not a list", {"peers": {"a": 1}}),
        ("too many peers", {"peers": [{}] * 65}),
    ],
)
def test_a_malformed_roster_is_refused(name: str, changes: dict[str, Any]) -> None:
    with pytest.raises(OverlayError):
        _check_roster(roster(**changes))


def test_the_preshared_key_follows_the_secret_and_only_it() -> None:
    one, again, other = preshared_key(b"a"), preshared_key(b"a"), preshared_key(b"b")
    assert one == again != other
    assert len(base64.b64decode(one)) == 32


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"port": 70000}, "cluster.overlay.port"),
        ({"subnet": "not a net"}, "cluster.overlay.subnet"),
        ({"subnet": "fd00::/64"}, "IPv4"),
        ({"subnet": "10.0.0.0/30"}, "/28"),
        ({"up": True, "interface": "wg0"}, "one of"),
    ],
)
def test_a_bad_overlay_setting_names_its_key(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("/", "/")):
        OverlayConfig(**changes)


def test_the_plain_network_is_off_by_default() -> None:
    cluster = ClusterConfig()
    assert not cluster.unsafe_plain_network
    assert not cluster.overlay.up and not cluster.overlay.interface


@pytest.mark.parametrize(
    "name",
    ["", "-h", "--help", 'wg"x', "wg x", "wg;flush", "..", "wg/../x", "a" * 16, "wg\nx"],
)
def test_an_interface_name_that_is_no_plain_word_is_refused_before_any_command(name: str) -> None:
    # the name is an argument of ip, wg and wireguard-go and a word of the nftables text
    with pytest.raises(OverlayError, match="a letter or digit first"):
        Interface(name=name, private_key="unused").up()


def test_a_secret_holder_joining_again_under_other_keys_takes_no_peers_place() -> None:
    """The hub of a split run knows its peers' names: a second JOIN as stage1 (another key) or
    one under a name that is no stage is refused, and the real peers get the roster."""
    import ipaddress
    import threading

    from netproto import Connection, Server
    from netproto.errors import RemoteError
    from world.overlay import OverlayMsg, Peer, _Hub

    hub = _Hub(num_peers=2, subnet=ipaddress.IPv4Network("10.213.128.0/24"),
               names=frozenset({"stage1", "stage2"}))  # fmt: skip
    keys = [base64.b64encode(bytes([i]) * 32).decode() for i in range(4)]
    replies: dict[str, Any] = {}

    def join(label: str, name: str, key: str) -> None:
        with Connection.connect(
            *server.address, secret=b"s", connect_timeout_s=HANG_GUARD_S
        ) as conn:
            try:
                payload = {"name": name, "public_key": key, "wg_port": 51820}
                roster = OverlayMsg.ROSTER
                reply = conn.request(
                    OverlayMsg.JOIN, payload, expect=roster, timeout_s=HANG_GUARD_S
                )
                replies[label] = reply.payload
            except RemoteError as exc:
                replies[label] = str(exc)

    with Server(hub.session, secret=b"s", name="hub").start() as server:
        first = threading.Thread(target=join, args=("stage1", "stage1", keys[0]))
        first.start()
        while len(hub.joined) < 1:
            threading.Event().wait(0.05)
        join("again", "stage1", keys[1])
        join("stranger", "stage9", keys[2])
        second = threading.Thread(target=join, args=("stage2", "stage2", keys[3]))
        second.start()
        peers = hub.wait_all(HANG_GUARD_S)
        hub.publish(Peer("hub", KEY, "10.213.0.1:51820", "10.213.128.1"), peers)
        for thread in (first, second):
            thread.join(timeout=HANG_GUARD_S)
            assert not thread.is_alive()
    assert "not a peer of this overlay" in replies["again"]
    assert "not a peer of this overlay" in replies["stranger"]
    assert sorted(p.name for p in peers) == ["stage1", "stage2"]
    assert replies["stage1"]["address"] == "10.213.128.2"
    assert replies["stage2"]["address"] == "10.213.128.3"
