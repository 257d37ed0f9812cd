"""Attacks on the overlay's interface handling and on a peer by its hub (world.overlay),
each in network namespaces of its own: an interface name another namespace's wireguard-go
serves, the name of an interface the host has, and a roster handing a peer its LAN address."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from labtools.hosts import Host, Network
from tests.clocks import HANG_GUARD_S
from world.overlay import unavailable as overlay_unavailable

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.skipif(
        overlay_unavailable() is not None, reason=f"no WireGuard here: {overlay_unavailable()}"
    ),
]

SECRET = "overlay-attack-secret"
HOLD = """
import sys, time
from world.overlay import Interface
wg = Interface(name=sys.argv[1])
try:
    wg.up()
    print("held", wg.public_key, flush=True)
    time.sleep(600)  # held until the network is taken down, however slow the test's steps
finally:
    wg.down()
"""
TAKE = """
import sys
from world.overlay import Interface, OverlayError
wg = Interface(name=sys.argv[1])
try:
    wg.up()
    print("took it", flush=True)
except OverlayError as exc:
    print(f"refused: {exc}", flush=True)
finally:
    wg.down()
"""
ROGUE_HUB = """
import json, sys, time
from netproto import Server
from world.overlay import OverlayMsg

def session(conn):
    join = conn.recv(expect=OverlayMsg.JOIN)
    conn.send(OverlayMsg.ROSTER, json.loads(sys.argv[2]), request_id=join.request_id)
    time.sleep(60)

Server(session, host=sys.argv[1], port=29499, secret=sys.argv[3].encode()).start()
print("serving", flush=True)
time.sleep(600)  # until the network is taken down
"""
LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 5001))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(b"hello")
    conn.close()
"""
DIAL = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 5001), timeout=float(sys.argv[2])) as conn:
        print(conn.recv(100).decode())
except OSError as exc:
    print(f"no connection: {exc}")
"""


def wait_for(log: Path, *texts: str, timeout_s: float = HANG_GUARD_S) -> str:
    """The log once it holds one of `texts`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = log.read_text() if log.exists() else ""
        if any(text in content for text in texts):
            return content
        time.sleep(0.2)
    raise AssertionError(f"none of {texts} in {log}: {log.read_text() if log.exists() else ''}")


def python(host: Host, code: str, log: Path, *args: str) -> None:
    host.start([sys.executable, "-c", code, *args], log)


def test_an_interface_name_served_in_another_namespace_is_refused_not_taken_over(
    tmp_path: Path,
) -> None:
    with Network(["owner", "intruder"], root=tmp_path / "hosts") as network:
        owner, intruder = network["owner"], network["intruder"]
        python(owner, HOLD, tmp_path / "owner.log", "labwgatkshared")
        key = wait_for(tmp_path / "owner.log", "held").split()[-1]
        python(intruder, TAKE, tmp_path / "intruder.log", "labwgatkshared")
        assert "refused" in wait_for(tmp_path / "intruder.log", "refused", "took it")
        # the owner's interface is still there, with its own key (wg asks its wireguard-go)
        shown = owner.run(["wg", "show", "labwgatkshared", "public-key"]).strip()
        assert shown == key


def test_an_interface_name_the_host_already_has_is_refused_and_left_alone(
    tmp_path: Path,
) -> None:
    with Network(["peer"], root=tmp_path / "hosts") as network:
        peer = network["peer"]
        proc = peer.start(
            [sys.executable, "-m", "world.overlay", "up", "--hub-address", "10.99.0.1",
             "--interface", "eth0"],
            tmp_path / "peer.log", env={"LAB_SECRET": SECRET},
        )  # fmt: skip
        assert proc.wait(timeout=HANG_GUARD_S) == 1
        assert peer.address in peer.run(["ip", "-o", "addr", "show", "dev", "eth0"])
        assert "exists already" in (tmp_path / "peer.log").read_text()


def test_a_roster_giving_a_peer_its_lan_address_is_refused(tmp_path: Path) -> None:
    with Network(["hub", "peer"], root=tmp_path / "hosts") as network:
        hub, peer = network["hub"], network["peer"]
        python(peer, LISTEN, tmp_path / "listen.log", peer.address)
        wait_for(tmp_path / "listen.log", "listening")
        hub_key = hub.run(["sh", "-c", "wg genkey | wg pubkey"]).strip()
        roster = {"address": peer.address, "prefix": 24, "peers": [
            {"name": "hub", "public_key": hub_key, "endpoint": f"{hub.address}:51820",
             "address": "10.213.128.1"}]}  # fmt: skip
        python(hub, ROGUE_HUB, tmp_path / "hub.log", hub.address, json.dumps(roster), SECRET)
        wait_for(tmp_path / "hub.log", "serving")
        peer.start(
            [sys.executable, "-m", "world.overlay", "up", "--hub-address", hub.address,
             "--interface", "labwgatkpeer"],
            tmp_path / "peer.log", env={"LAB_SECRET": SECRET},
        )  # fmt: skip
        outcome = wait_for(tmp_path / "peer.log", "overlay up", "error:")
        assert "error:" in outcome and "holds already" in outcome, outcome
        dialled = hub.run([sys.executable, "-c", DIAL, peer.address, "60"])  # must connect
        assert dialled.strip() == "hello"  # the peer's LAN address still answers its LAN
