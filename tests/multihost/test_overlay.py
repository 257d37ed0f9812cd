"""Split runs across hosts listen only inside the lab's WireGuard overlay (world.overlay):
a stranger on the same LAN, without the secret, reaches none of their ports, even routing the
overlay's addresses through a host's LAN address; a split run that would listen on the plain
network refuses to start."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from labtools.hosts import ATTACKS, OVERLAY_PREFIX, Exposure, Host, Network, probe_exposure
from tests.clocks import HANG_GUARD_S
from world.overlay import unavailable as overlay_unavailable

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.skipif(
        overlay_unavailable() is not None, reason=f"no WireGuard here: {overlay_unavailable()}"
    ),
]

SECRET = "overlay-test-secret"
LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 5001))
print("listening", flush=True)
while True:
    conn, peer = server.accept()
    conn.sendall(f"hello {peer[0]}".encode())
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
REACHES_S = "60"
"""DIAL's wait where it must connect: a WireGuard handshake on a busy machine may take seconds."""
BLOCKED_S = "3"
"""Its wait where it must not: a busy machine can only make a wrong connection later."""


def overlay_up(host: Host, log: Path, *args: str) -> subprocess.Popen:
    proc = host.start([sys.executable, "-m", "world.overlay", "up", *args], log,
                      env={"LAB_SECRET": SECRET})  # fmt: skip
    return proc


def wait_for(log: Path, text: str, timeout_s: float = HANG_GUARD_S) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = log.read_text() if log.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {log}: {log.read_text() if log.exists() else ''}")


def test_the_overlay_joins_two_hosts_and_its_guard_keeps_the_lan_out(tmp_path: Path) -> None:
    with Network(["hub", "peer", "stranger"], root=tmp_path / "hosts") as network:
        hub, peer, stranger = network["hub"], network["peer"], network["stranger"]
        overlay_up(hub, tmp_path / "hub.log", "--hub", "--listen", hub.address, "--peers", "1",
                   "--interface", "labwgtesthub")  # fmt: skip
        overlay_up(peer, tmp_path / "peer.log", "--hub-address", hub.address,
                   "--interface", "labwgtestpeer")  # fmt: skip
        hub_line = wait_for(tmp_path / "hub.log", "overlay up")
        wait_for(tmp_path / "peer.log", "overlay up")
        assert f"address {OVERLAY_PREFIX}1" in hub_line
        hub.start([sys.executable, "-c", LISTEN, f"{OVERLAY_PREFIX}1"], tmp_path / "listen.log")
        wait_for(tmp_path / "listen.log", "listening")

        through_overlay = peer.run([sys.executable, "-c", DIAL, f"{OVERLAY_PREFIX}1", REACHES_S])
        assert through_overlay.strip() == f"hello {OVERLAY_PREFIX}2"  # the peer's overlay address

        # a LAN neighbour routes the overlay address through the hub's LAN address
        subprocess.run(["ip", "-n", stranger.netns, "route", "add", f"{OVERLAY_PREFIX}1/32",
                        "via", hub.address], check=True)  # fmt: skip
        guarded = stranger.run([sys.executable, "-c", DIAL, f"{OVERLAY_PREFIX}1", BLOCKED_S])
        assert guarded.startswith("no connection"), guarded
        # the guard is what stops it: without the nftables table the same route connects
        tables = hub.run(["nft", "-j", "list", "tables"])
        names = [t["table"]["name"] for t in json.loads(tables)["nftables"] if "table" in t]
        assert names == ["lab_labwgtesthub"]
        hub.run(["nft", "delete", "table", "inet", "lab_labwgtesthub"])
        unguarded = stranger.run([sys.executable, "-c", DIAL, f"{OVERLAY_PREFIX}1", REACHES_S])
        assert unguarded.strip() == f"hello {stranger.address}"


def test_an_overlay_peer_without_the_secret_is_refused_and_the_hub_waits_on(tmp_path: Path) -> None:
    with Network(["hub", "peer"], root=tmp_path / "hosts") as network:
        hub, peer = network["hub"], network["peer"]
        overlay_up(hub, tmp_path / "hub.log", "--hub", "--listen", hub.address, "--peers", "1",
                   "--interface", "labwgtesthub")  # fmt: skip
        wait_for(tmp_path / "hub.log", "waiting for 1 peers")
        wrong = peer.start(
            [sys.executable, "-m", "world.overlay", "up", "--hub-address", hub.address,
             "--interface", "labwgtestbad"],
            tmp_path / "wrong.log", env={"LAB_SECRET": "not the secret"},
        )  # fmt: skip
        assert wrong.wait(timeout=HANG_GUARD_S) == 1
        assert "error:" in (tmp_path / "wrong.log").read_text()
        overlay_up(peer, tmp_path / "peer.log", "--hub-address", hub.address,
                   "--interface", "labwgtestpeer")  # fmt: skip
        wait_for(tmp_path / "peer.log", "overlay up")


def test_a_split_run_on_the_plain_network_refuses_to_start_in_one_line(tmp_path: Path) -> None:
    with Network(["desktop"], root=tmp_path / "hosts") as network:
        desktop = network["desktop"]
        result = subprocess.run(
            ["ip", "netns", "exec", desktop.netns, sys.executable, "-m", "split_inference",
             "role=driver", f"cluster.master.host={desktop.address}", "cluster.master.port=29530",
             "model.lab_preset=debug"],
            capture_output=True, text=True, env=desktop.env({"LAB_SECRET": SECRET}),
            timeout=HANG_GUARD_S, check=False, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "cluster.overlay.up=true" in errors[0] and "eth0" in errors[0]


@pytest.fixture(scope="module")
def exposure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exposure]:
    yield probe_exposure(tmp_path_factory.mktemp("exposure"), module="split_training")


def test_the_split_run_under_attack_trains_to_the_end(exposure: Exposure) -> None:
    assert exposure.run_ok, exposure.detail


def test_every_listener_of_a_split_run_is_on_the_overlay_or_loopback(exposure: Exposure) -> None:
    assert {item.host for item in exposure.listeners} == {"desktop", "laptop", "pc"}
    outside = [
        item
        for item in exposure.listeners
        if not item.address.startswith((OVERLAY_PREFIX, "127.")) and item.address != "::1"
    ]
    assert outside == []


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_stranger_on_the_lan_reaches_no_port_of_a_split_run(
    exposure: Exposure, attack: str
) -> None:
    tries = exposure.attempts[attack]
    assert tries, f"no port of the run for {attack}"
    assert exposure.reached[attack] == 0, [t for t in tries if t.startswith("connected")]


def test_another_local_user_reaches_no_port_of_a_split_run_on_its_host(exposure: Exposure) -> None:
    """On every host of the run, another local user (uid nobody) reaches none of the run's
    listeners on the host's overlay address (the fence, world.fence); controls in the same
    script: a listener of its own on the LAN address takes that user's connection, and one on
    the overlay address takes the run's own user's."""
    assert set(exposure.local) == {"desktop", "laptop", "pc"}, exposure.local
    for host, reached in exposure.local.items():
        assert reached["other user"], host
        assert all(r.startswith("no connection") for r in reached["other user"]), (host, reached)
        assert reached["other user, overlay control"].startswith("no connection"), reached
        assert reached["other user, unfenced LAN control"] == "connected", (host, reached)
        assert reached["run's user, overlay control"] == "connected", (host, reached)
