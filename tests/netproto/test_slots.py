"""Who may hold a server's connection slots: a frame must keep arriving at a minimum rate (a
peer dribbling bytes just within the read timeout is cut, with or without a secret), and one
remote address holds at most its share of the slots."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab.cluster import limits_for, serve
from lab.config import ClusterConfig, Endpoint
from netproto import Connection, Limits, MsgType, NetprotoError, Server
from netproto.codecs import encode_bytes as frame
from netproto.header import HEADER, HEADER_BYTES, MAGIC, PROTOCOL_VERSION, Message, PayloadKind
from netproto.server import address_key
from netproto.wire import FrameDecoder
from tests.clocks import HANG_GUARD_S

from .conftest import echo_handler, wait_for
from .test_before_auth import closed_by_peer, read_message

SECRET = b"correct horse battery staple"
SECRETS = [None, SECRET]
SECRET_IDS = ["open", "secret"]
DRIBBLE_STEP_S = 0.2
"""A byte this often: ten times inside the read timeout these tests set (2 s)."""
READ_TIMEOUT_S = 2.0
GRACE_S = 0.5
OTHER_HOST = "127.0.0.2"
"""A second source address on loopback: another host, as far as the server can tell."""


def announced(length: int) -> bytes:
    """A DATA_BYTES frame's header announcing `length` payload bytes."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, MsgType.DATA_BYTES, PayloadKind.BYTES, 0, length)


def dribble(sock: socket.socket, data: bytes, *, stop: threading.Event | None = None) -> int:
    """Send `data` a byte every DRIBBLE_STEP_S; how many bytes went out before the peer closed
    the connection (len(data) if it never did, or `stop` came first)."""
    for sent, byte in enumerate(data):
        if stop is not None and stop.is_set():
            return sent
        try:
            sock.sendall(bytes([byte]))
            readable, _, _ = select.select([sock], [], [], DRIBBLE_STEP_S)
            if readable and not sock.recv(4096):
                return sent + 1
        except OSError:  # reset: closed by the server
            return sent + 1
    return len(data)


def connect_from(
    server: Server, host: str = "127.0.0.1", *, secret: bytes | None = None
) -> Connection:
    return Connection.connect(
        *server.address, secret=secret, connect_timeout_s=HANG_GUARD_S, source_address=(host, 0)
    )


def served(server: Server, host: str = "127.0.0.1", *, secret: bytes | None = None) -> bool:
    """Whether a client from `host` connects and gets an answer (not closed on at accept)."""
    try:
        with connect_from(server, host, secret=secret) as conn:
            reply = conn.request(MsgType.DATA_JSON, {"hello": host}, expect=MsgType.DATA_JSON)
            return reply.payload == {"hello": host}
    except (NetprotoError, OSError):
        return False


@pytest.fixture
def held() -> Iterator[list[Connection]]:
    """Connections a test keeps open; closed at its end."""
    conns: list[Connection] = []
    yield conns
    for conn in conns:
        conn.close()


# ------------------------------------------------------------------ the frame deadline


@pytest.mark.parametrize("secret", SECRETS, ids=SECRET_IDS)
def test_dribblers_in_every_slot_are_cut_by_the_frame_deadline_and_an_honest_client_gets_in(
    start_server, held: list[Connection], caplog: pytest.LogCaptureFixture, secret: bytes | None
) -> None:
    """Four peers take all four slots (authenticated, with a secret) and then dribble a frame
    a byte every 0.2 s: each read is served long within the read timeout (the hang guard here:
    a dribbler stalled by a busy machine must not be cut by it instead), so only a deadline on
    the whole frame frees the slots for a client that comes later."""
    caplog.set_level(logging.WARNING, logger="netproto")
    server = start_server(
        secret=secret,
        max_connections=4,
        read_timeout_s=HANG_GUARD_S,
        limits=Limits(frame_grace_s=GRACE_S),
    )
    for _ in range(4):
        held.append(connect_from(server, secret=secret))
    assert wait_for(lambda: server.sessions_authenticated == 4)
    stop = threading.Event()
    payload = announced(1000) + bytes(1000)  # 200 s of dribbling, never a whole frame
    dribblers = [
        threading.Thread(target=dribble, args=(conn._sock, payload), kwargs={"stop": stop})
        for conn in held
    ]
    for thread in dribblers:
        thread.start()
    try:
        assert wait_for(lambda: served(server, secret=secret), timeout_s=HANG_GUARD_S)
    finally:
        stop.set()
        for thread in dribblers:
            thread.join(timeout=HANG_GUARD_S)
    assert not any(thread.is_alive() for thread in dribblers)
    assert wait_for(lambda: server.sessions_failed == 4)
    cut = [r.getMessage() for r in caplog.records if "the frame deadline" in r.getMessage()]
    assert len(cut) == 4, cut


def test_a_huge_frame_dribbled_is_cut_after_the_grace_not_after_its_size_at_the_rate(
    start_server,
) -> None:
    """A header announcing 100 MB, whole, then its payload a byte at a time: at 1 Mbit/s
    the frame could take 800 s, but the deadline moves on only with the bytes that come."""
    server = start_server(read_timeout_s=READ_TIMEOUT_S, limits=Limits(frame_grace_s=GRACE_S))
    with socket.create_connection(server.address) as sock:
        sock.sendall(announced(100_000_000))
        sent = dribble(sock, bytes(100))  # 20 s if nothing cut it
    assert sent < 100
    assert wait_for(lambda: server.sessions_failed == 1)


def test_a_frame_slower_than_the_grace_but_above_the_minimum_rate_arrives(start_server) -> None:
    """60 kB in 6 kB pieces every 0.1 s: at least 0.9 s (the sleeps), beyond the 0.5 s grace,
    at about a hundred times the 500 B/s minimum: each piece buys 12 s, so a test thread
    stalled by a busy machine between two pieces is not cut (at 5 kB/s, 1.7 s would have)."""
    server = start_server(
        read_timeout_s=HANG_GUARD_S,
        limits=Limits(min_frame_bytes_per_s=500, frame_grace_s=GRACE_S),
    )
    payload = pattern(60_000)
    data = frame(Message(MsgType.DATA_BYTES, payload))
    with socket.create_connection(server.address) as sock:
        for start in range(0, len(data), 6_000):
            sock.sendall(data[start : start + 6_000])
            time.sleep(0.1)
        reply = read_message(sock)
    assert reply is not None and reply.payload == payload
    assert server.sessions_failed == 0


def pattern(size: int) -> bytes:
    return (bytes(range(256)) * (size // 256 + 1))[:size]


def test_the_deadline_moves_on_with_each_byte_of_the_frame() -> None:
    """The reader counts the bytes of the frame in progress, header included, whatever path
    it takes (a small frame in the read buffer, a big payload in its own)."""
    limits = Limits(min_frame_bytes_per_s=1000, frame_grace_s=2.0)
    assert limits.frame_allowance_s(0) == 2.0
    assert limits.frame_allowance_s(500) == 2.5
    assert Limits(min_frame_bytes_per_s=0).frame_allowance_s(10**9) == float("inf")
    for size in (100, 200_000):  # fits the read buffer / gets a buffer of its own
        data = frame(Message(MsgType.DATA_BYTES, pattern(size)))
        decoder = FrameDecoder()
        assert decoder.frame_progress == 0
        for cut in (5, HEADER_BYTES, HEADER_BYTES + 50, len(data) - 1):
            decoder = FrameDecoder()
            decoder.feed(data[:cut])
            assert decoder.next_message() is None
            assert decoder.frame_progress == cut, (size, cut)
            decoder.feed(data[cut:])
            assert decoder.next_message() is not None
            assert decoder.frame_progress == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_frame_bytes_per_s": -1.0}, "Limits.min_frame_bytes_per_s"),
        ({"min_frame_bytes_per_s": float("inf")}, "Limits.min_frame_bytes_per_s"),
        ({"frame_grace_s": 0.0}, "Limits.frame_grace_s"),
        ({"frame_grace_s": float("nan")}, "Limits.frame_grace_s"),
    ],
)
def test_bad_frame_deadlines_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Limits(**fields)


# ------------------------------------------------------------------ one address's share


@pytest.mark.parametrize("secret", SECRETS, ids=SECRET_IDS)
def test_one_address_cannot_take_every_slot(
    start_server, held: list[Connection], secret: bytes | None
) -> None:
    """127.0.0.1 asks for six sessions of eight: it gets its two, the rest are closed at
    accept, and a client from another address is served."""
    server = start_server(secret=secret, max_connections=8, max_connections_per_address=2)
    for _ in range(6):
        with contextlib.suppress(NetprotoError, OSError):  # closed at accept: fails here
            conn = connect_from(server, secret=secret)
            held.append(conn)
            conn.ping()
    assert sum(not conn.closed for conn in held) == 2
    assert wait_for(lambda: server.sessions_capped == 4)
    assert server.sessions_of("127.0.0.1") == 2
    assert served(server, OTHER_HOST, secret=secret)
    assert server.sessions_refused == 4  # the capped ones only: nobody else paid
    for conn in held:  # the two admitted ones still work
        if not conn.closed:
            conn.ping()


def test_strangers_over_their_share_drop_only_their_own_addresss_sessions(start_server) -> None:
    server = start_server(
        secret=SECRET,
        handshake_timeout_s=60,  # nobody leaves by timing out
        max_connections=50,
        max_unauthenticated=50,
        max_connections_per_address=3,
    )
    with socket.create_connection(server.address, source_address=(OTHER_HOST, 0)) as other:
        assert wait_for(lambda: server.sessions_of(OTHER_HOST) == 1)
        crowd = []
        try:
            for count in range(10):
                crowd.append(socket.create_connection(server.address))
                assert wait_for(lambda: server.sessions_started == count + 2)  # noqa: B023
            assert all(closed_by_peer(sock) for sock in crowd[:7])
            assert not any(closed_by_peer(sock, timeout_s=0.2) for sock in crowd[7:])
            assert not closed_by_peer(other, timeout_s=0.2)
            assert server.sessions_of("127.0.0.1") == 3
            assert server.sessions_evicted == 7
            assert server.sessions_refused == 0
        finally:
            for sock in crowd:
                sock.close()


def test_an_address_is_counted_as_its_host_not_its_port() -> None:
    assert address_key("10.1.2.3") == "10.1.2.3"
    assert address_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::2")
    assert address_key("2001:db8:1:2:aaaa::1") != address_key("2001:db8:1:3::1")
    assert address_key("fe80::1%eth0") == "fe80::/64"


# ------------------------------------------------------------------ from the cluster settings


def test_cluster_settings_set_the_minimum_rate_and_the_share() -> None:
    cluster = ClusterConfig(min_frame_rate_kbps=800, max_connections_per_address=5)
    assert limits_for(cluster).min_frame_bytes_per_s == 100_000
    server = serve(echo_handler, cluster, Endpoint(), name="t")
    try:
        assert server.max_connections_per_address == 5
        assert server.limits.min_frame_bytes_per_s == 100_000
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_frame_rate_kbps": -1.0}, "cluster.min_frame_rate_kbps=-1.0 must be"),
        ({"min_frame_rate_kbps": float("nan")}, "cluster.min_frame_rate_kbps=nan must be"),
        ({"max_connections_per_address": 0}, "cluster.max_connections_per_address=0 must be"),
    ],
)
def test_bad_cluster_slot_settings_are_refused_naming_the_key(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**fields)
