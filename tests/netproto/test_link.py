"""The link emulator adds at least the configured delay and holds to the bandwidth cap."""

from __future__ import annotations

import time

import pytest
import torch

from netproto import Connection, LinkEmulator, LinkEmulatorProcess, MsgType
from tests.clocks import HANG_GUARD_S

from .conftest import wait_for


def round_trips_s(address: tuple[str, int], samples: int = 5) -> list[float]:
    with Connection.connect(*address) as conn:
        conn.ping()
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            conn.ping()
            times.append(time.perf_counter() - started)
    return times


@pytest.mark.parametrize("emulator", [LinkEmulator, LinkEmulatorProcess])
def test_delay_is_added_each_way(start_server, emulator) -> None:
    server = start_server()
    with emulator(server.address, delay_ms=40) as link:
        shaped = round_trips_s(link.address)
    # Every round trip, not the median, holds 40 ms there + 40 ms back: the emulator stamps a
    # chunk after it read it and sends it no sooner than that stamp + the delay. (No upper bound,
    # and no comparison with an unshaped round trip: the difference of two medians taken at
    # different moments is the machine's load, not the link's delay; CI once saw 77 ms so.)
    assert min(shaped) >= 0.080, shaped


def test_link_process_goes_when_stopped(start_server) -> None:
    link = LinkEmulatorProcess(start_server().address, delay_ms=1).start()
    proc = link._proc
    assert proc is not None and proc.poll() is None
    link.stop()
    assert proc.poll() is not None
    with pytest.raises(RuntimeError, match="not started"):
        _ = link.address


def test_link_process_refuses_a_bad_upstream() -> None:
    from netproto.link import main

    with pytest.raises(SystemExit):
        main(["--upstream", "no-port-here"])


def test_bandwidth_cap_slows_bulk_transfer(start_server) -> None:
    server = start_server()
    payload = torch.zeros(250_000)  # 1 MB
    with (
        LinkEmulator(server.address, bandwidth_mbps=40) as link,
        Connection.connect(*link.address) as conn,
    ):
        started = time.perf_counter()
        conn.send_tensor(MsgType.DATA_TENSOR, payload)
        conn.recv_tensor(MsgType.DATA_TENSOR)
        elapsed = time.perf_counter() - started
    # 1 MB each way at 40 Mbit/s: >= 0.4 s, a floor the emulator guarantees (each chunk departs
    # no sooner than its read + the bytes before it / the rate, and the echo starts only once
    # the whole request has come); a busy machine only adds to it
    assert elapsed >= 2 * 8e6 / 40e6 * 0.95


def test_emulated_link_carries_data_intact_and_closes_cleanly(start_server) -> None:
    server = start_server()
    value = torch.randn(1000, 100)
    with (
        LinkEmulator(server.address, delay_ms=1, bandwidth_mbps=1000) as link,
        Connection.connect(*link.address) as conn,
    ):
        reply = conn.request(MsgType.DATA_TENSOR, value, expect=MsgType.DATA_TENSOR)
        assert torch.equal(reply.payload, value)
    assert wait_for(lambda: server.active_sessions == 0, timeout_s=HANG_GUARD_S)


def test_cluster_settings_build_an_authenticated_shaped_connection(
    start_server, monkeypatch
) -> None:
    from lab.cluster import connect, emulated_link, serve
    from lab.config import ClusterConfig, Endpoint, LinkConfig

    monkeypatch.setenv("LAB_SECRET", "from-the-environment")
    cluster = ClusterConfig(link=LinkConfig(delay_ms=30), max_frame_mib=1)

    def answer_pings(conn: Connection) -> None:
        conn.recv(expect=MsgType.DATA_JSON)  # answers PINGs while it waits

    server = serve(answer_pings, cluster, Endpoint(), name="t")
    try:
        with emulated_link(cluster, server.address) as address, connect(cluster, address) as conn:
            assert address != server.address
            started = time.perf_counter()
            conn.ping()
            assert time.perf_counter() - started >= 0.060  # a floor: 30 ms stamped each way
        assert server.secret == b"from-the-environment"
        assert server.limits.max_frame_bytes == 2**20
    finally:
        server.stop()


def test_stop_waits_once_for_all_its_threads_not_once_each(
    start_server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Pump threads that do not end (stuck in a send): `stop` gives them STOP_WAIT_S in all,
    then says how many it left, instead of STOP_WAIT_S each. (What is asserted is the waits it
    asked for: a slow machine only makes the later ones zero sooner.)"""
    import threading

    import netproto.link

    monkeypatch.setattr(netproto.link, "STOP_WAIT_S", 0.3)
    waits: list[float] = []

    class Stuck:
        name = "stuck"

        def join(self, timeout: float | None = None) -> None:
            assert timeout is not None
            waits.append(timeout)
            threading.Event().wait(timeout)  # waits it all out

        def is_alive(self) -> bool:
            return True

    link = LinkEmulator(start_server().address, delay_ms=1).start()
    link._threads.extend(Stuck() for _ in range(5))  # type: ignore[misc]
    with caplog.at_level("WARNING", logger="netproto.link"):
        link.stop()
    assert 0 < waits[0] <= 0.3 and waits[1:] == [0.0] * 4  # 0.3 s in all, not 5 x 0.3
    assert "5 pump threads still running" in caplog.text
