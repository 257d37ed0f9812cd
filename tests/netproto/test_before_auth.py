"""Strangers before authentication: one deadline for the whole handshake (TLS's included),
nothing but handshake frames, and a crowd of slow or idle connections cannot lock peers out."""

from __future__ import annotations

import contextlib
import errno
import logging
import resource
import select
import socket
import ssl
import threading
from collections.abc import Iterator

import pytest

from netproto import (
    AuthenticationError,
    Connection,
    MsgType,
    NetTimeout,
    Server,
    client_ssl_context,
    server_ssl_context,
)
from netproto.auth import mac
from netproto.codecs import encode_bytes as frame
from netproto.header import HEADER, MAGIC, PROTOCOL_VERSION, Message, PayloadKind
from netproto.listener import StopSignal, accept_until
from netproto.wire import FrameDecoder
from tests.clocks import HANG_GUARD_S

from .conftest import wait_for

SECRET = b"correct horse battery staple"
CHALLENGE = frame(Message(MsgType.AUTH_CHALLENGE, b"\x01" * 32))
TRICKLE_STEP_S = 0.1
TRICKLE_BYTES = 100  # 10 s of trickling: 20x the handshake deadline these tests set


def read_message(sock: socket.socket, timeout_s: float = HANG_GUARD_S) -> Message | None:
    """The next whole message from a raw socket, or None when the server closed it first."""
    decoder = FrameDecoder()
    sock.settimeout(timeout_s)
    while True:
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            return None
        if not data:
            return None
        decoder.feed(data)
        if (message := decoder.next_message()) is not None:
            return message


def closed_by_peer(sock: socket.socket, timeout_s: float = HANG_GUARD_S) -> bool:
    """Whether the other end closes `sock` within `timeout_s`, whatever it sent first."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def trickle(sock: socket.socket, data: bytes) -> int:
    """Send `data` a byte every TRICKLE_STEP_S; how many bytes went out before the peer closed
    the connection (len(data) if it never did)."""
    for sent, byte in enumerate(data):
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return sent
        readable, _, _ = select.select([sock], [], [], TRICKLE_STEP_S)
        if readable:
            try:
                if not sock.recv(4096):
                    return sent + 1
            except ConnectionResetError:
                return sent + 1
    return len(data)


def client_hello() -> bytes:
    """The first flight of a real TLS client (a ClientHello), without any socket."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def stalled_challenge() -> bytes:
    """An AUTH_CHALLENGE header announcing 4000 bytes: trickled, it never completes a frame."""
    return HEADER.pack(
        MAGIC, PROTOCOL_VERSION, 0, MsgType.AUTH_CHALLENGE, PayloadKind.BYTES, 0, 4000
    ) + bytes(4000)


# ------------------------------------------------------------------ one deadline


def test_handshake_deadline_is_not_stretched_by_a_byte_at_a_time(start_server) -> None:
    server = start_server(secret=SECRET, handshake_timeout_s=0.5)
    with socket.create_connection(server.address) as sock:
        sent = trickle(sock, stalled_challenge()[:TRICKLE_BYTES])
    assert sent < TRICKLE_BYTES  # a per-read timeout would have waited for every byte
    assert wait_for(lambda: server.sessions_failed == 1)
    assert server.sessions_authenticated == 0


def test_tls_handshake_deadline_is_not_stretched_by_a_byte_at_a_time(
    start_server, certificate: tuple[str, str]
) -> None:
    cert, key = certificate
    server = start_server(
        secret=SECRET,
        ssl_context=server_ssl_context(cert=cert, key=key),
        handshake_timeout_s=0.5,
    )
    hello = client_hello()
    assert len(hello) > TRICKLE_BYTES
    with socket.create_connection(server.address) as sock:
        sent = trickle(sock, hello[:TRICKLE_BYTES])
    assert sent < TRICKLE_BYTES
    assert wait_for(lambda: server.sessions_failed == 1)


def test_client_handshake_deadline_bounds_a_slow_server() -> None:
    """A server dribbling its AUTH_RESPONSE cannot hold a client past connect_timeout_s."""
    listener = socket.create_server(("127.0.0.1", 0))
    response = frame(Message(MsgType.AUTH_RESPONSE, b"\x00" * 64))
    sent: list[int] = []

    def dribbling_server() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            sent.append(trickle(conn, response))

    thread = threading.Thread(target=dribbling_server)
    thread.start()
    try:
        with pytest.raises(NetTimeout, match="did not finish in time"):
            Connection.connect(*listener.getsockname(), secret=SECRET, connect_timeout_s=0.5)
    finally:
        thread.join(timeout=30)
        listener.close()
    assert not thread.is_alive()
    assert sent[0] < len(response)  # the client hung up before the reply was complete


# ------------------------------------------------------------------ only handshake frames


@pytest.mark.parametrize("first", [MsgType.PING, MsgType.PONG, MsgType.BYE])
def test_first_frame_other_than_the_challenge_is_refused(start_server, first: MsgType) -> None:
    server = start_server(secret=SECRET)
    with socket.create_connection(server.address) as sock:
        sock.sendall(frame(Message(first, request_id=7)))
        reply = read_message(sock)
        assert reply is not None and reply.type == MsgType.ERROR  # no PONG
        assert reply.payload["code"] == "auth_required"
        assert closed_by_peer(sock)
    assert wait_for(lambda: server.sessions_failed == 1)


def test_ping_in_the_middle_of_the_handshake_is_refused(start_server) -> None:
    server = start_server(secret=SECRET)
    with socket.create_connection(server.address) as sock:
        sock.sendall(CHALLENGE)
        response = read_message(sock)
        assert response is not None and response.type == MsgType.AUTH_RESPONSE
        sock.sendall(frame(Message(MsgType.PING, request_id=3)))
        reply = read_message(sock)
        assert reply is not None and reply.type == MsgType.ERROR  # no PONG
        assert reply.payload["code"] == "protocol_error"
        assert "PING during the handshake" in reply.payload["message"]
        assert closed_by_peer(sock)
    assert wait_for(lambda: server.sessions_failed == 1)
    assert server.sessions_authenticated == 0


def test_client_refuses_a_ping_in_place_of_the_servers_reply() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def pinging_server() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(frame(Message(MsgType.PING, request_id=1)))
            closed_by_peer(conn)

    thread = threading.Thread(target=pinging_server)
    thread.start()
    try:
        with pytest.raises(AuthenticationError, match="PING during the handshake"):
            Connection.connect(*listener.getsockname(), secret=SECRET, connect_timeout_s=10)
    finally:
        thread.join(timeout=30)
        listener.close()
    assert not thread.is_alive()


# ------------------------------------------------------------------ crowding


def netproto_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith("netproto") and r.levelno >= logging.WARNING
    ]


def idle_strangers(server: Server, count: int) -> list[socket.socket]:
    """`count` connections that never send a byte, registered by the server in order."""
    socks = []
    for _ in range(count):
        taken_in = connections_taken_in(server)
        socks.append(socket.create_connection(server.address))
        assert wait_until_taken_in(server, taken_in + 1)
    return socks


def connections_taken_in(server: Server) -> int:
    """Connections the server has accepted and dealt with (admitted or refused)."""
    return server.sessions_started + server.sessions_refused


def wait_until_taken_in(server: Server, count: int, timeout_s: float = HANG_GUARD_S) -> bool:
    return wait_for(lambda: connections_taken_in(server) >= count, timeout_s=timeout_s)


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_full_server_drops_the_oldest_stranger_for_an_honest_client(start_server) -> None:
    server = start_server(secret=SECRET, max_connections=3, max_unauthenticated=3)
    strangers = idle_strangers(server, 3)
    try:
        with Connection.connect(*server.address, secret=SECRET) as conn:
            conn.ping()
        assert closed_by_peer(strangers[0])  # the oldest made way
        for sock in strangers[1:]:
            assert not closed_by_peer(sock, timeout_s=0.2)
        assert server.sessions_evicted == 1
        assert server.sessions_refused == 0
    finally:
        close_all(strangers)


def test_strangers_beyond_max_unauthenticated_push_out_the_oldest(start_server) -> None:
    server = start_server(secret=SECRET, max_connections=50, max_unauthenticated=2)
    strangers = idle_strangers(server, 4)
    try:
        assert closed_by_peer(strangers[0]) and closed_by_peer(strangers[1])
        assert not closed_by_peer(strangers[3], timeout_s=0.2)
        assert server.sessions_evicted == 2
        assert server.unauthenticated_sessions == 2
    finally:
        close_all(strangers)


def test_silent_strangers_make_way_before_a_client_mid_handshake(start_server) -> None:
    server = start_server(secret=SECRET, max_connections=50, max_unauthenticated=3)
    with socket.create_connection(server.address) as honest:  # the oldest, but it is talking
        nonce_c = b"\x02" * 32
        honest.sendall(frame(Message(MsgType.AUTH_CHALLENGE, nonce_c)))
        response = read_message(honest)
        assert response is not None and response.type == MsgType.AUTH_RESPONSE
        strangers = idle_strangers(server, 6)
        try:
            nonce_s = response.payload[:32]
            honest.sendall(
                frame(Message(MsgType.AUTH_PROOF, mac(SECRET, b"cli", nonce_s, nonce_c)))
            )
            ok = read_message(honest)
            assert ok is not None and ok.type == MsgType.AUTH_OK
            assert server.sessions_evicted == 4  # silent ones only
        finally:
            close_all(strangers)


def test_idle_strangers_cost_no_thread(start_server) -> None:
    server = start_server(secret=SECRET, name="lazy")

    def session_threads() -> int:
        return sum(t.name == "lazy-session" for t in threading.enumerate())

    strangers = idle_strangers(server, 20)
    try:
        assert session_threads() == 0
        strangers[0].sendall(CHALLENGE)  # it speaks: now it has a thread, and an answer
        reply = read_message(strangers[0])
        assert reply is not None and reply.type == MsgType.AUTH_RESPONSE
        assert session_threads() == 1
    finally:
        close_all(strangers)


def test_silent_connection_is_closed_at_the_handshake_deadline(start_server) -> None:
    server = start_server(secret=SECRET, handshake_timeout_s=0.5)
    with socket.create_connection(server.address) as sock:
        assert closed_by_peer(sock)
    assert wait_for(lambda: server.sessions_failed == 1)
    assert server.active_sessions == 0


def test_newcomer_is_refused_only_when_every_slot_is_authenticated(start_server) -> None:
    server = start_server(secret=SECRET, max_connections=2)
    with (
        Connection.connect(*server.address, secret=SECRET) as first,
        Connection.connect(*server.address, secret=SECRET) as second,
    ):
        first.ping()
        second.ping()
        with socket.create_connection(server.address) as sock:
            assert closed_by_peer(sock)
        assert wait_for(lambda: server.sessions_refused == 1)
        assert server.sessions_evicted == 0
        first.ping()  # authenticated sessions are never dropped
        second.ping()


def test_open_server_counts_every_connection_as_authenticated(start_server) -> None:
    """Without a secret or TLS there is no stranger to drop: see the README's netproto notes."""
    server = start_server(max_connections=2)
    holders = idle_strangers(server, 2)
    try:
        assert wait_for(lambda: server.sessions_authenticated == 2)
        with socket.create_connection(server.address) as sock:
            assert closed_by_peer(sock)
        assert server.sessions_refused == 1
        assert server.sessions_evicted == 0
    finally:
        close_all(holders)


@pytest.fixture
def crowd() -> Iterator[list[socket.socket]]:
    """A list to put stranger sockets in; they are closed at the end of the test."""
    socks: list[socket.socket] = []
    yield socks
    close_all(socks)


NUM_STRANGERS = 1000
NUM_HONEST_ATTEMPTS = 20


@pytest.fixture
def file_descriptors_for_the_crowd() -> Iterator[None]:
    """Room for NUM_STRANGERS connections (both ends, plus pytest's own files): the soft limit
    on open files raised as far as needed while the test runs."""
    needed = 2 * NUM_STRANGERS + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        yield
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} open files, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("file_descriptors_for_the_crowd")
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_honest_client_gets_in_past_a_thousand_slow_or_idle_strangers(
    start_server,
    certificate: tuple[str, str],
    crowd: list[socket.socket],
    caplog: pytest.LogCaptureFixture,
    tls: bool,
) -> None:
    caplog.set_level(logging.DEBUG, logger="netproto")
    cert, key = certificate
    server = start_server(
        secret=SECRET,
        ssl_context=server_ssl_context(cert=cert, key=key) if tls else None,
        handshake_timeout_s=300,  # no stranger leaves by timing out: each one must be dropped
    )
    # half idle, half trickling a first flight that never completes (ClientHello or challenge)
    stalled = client_hello() if tls else stalled_challenge()
    for _ in range(NUM_STRANGERS):
        crowd.append(socket.create_connection(server.address, timeout=30))
    stop = threading.Event()

    def trickle_crowd() -> None:
        for position in range(len(stalled) - 1):
            for sock in crowd[::2]:
                with contextlib.suppress(OSError):  # dropped by the server: fine
                    sock.send(stalled[position : position + 1])
            if stop.wait(0.05):
                return

    trickler = threading.Thread(target=trickle_crowd)
    trickler.start()
    try:
        assert wait_until_taken_in(server, NUM_STRANGERS, timeout_s=HANG_GUARD_S)
        context = client_ssl_context(ca=cert) if tls else None
        for attempt in range(NUM_HONEST_ATTEMPTS):
            with Connection.connect(
                *server.address, secret=SECRET, ssl_context=context, connect_timeout_s=60
            ) as conn:
                reply = conn.request(
                    MsgType.DATA_JSON, {"attempt": attempt}, expect=MsgType.DATA_JSON
                )
                assert reply.payload == {"attempt": attempt}
    finally:
        stop.set()
        trickler.join(timeout=30)
    assert not trickler.is_alive()
    assert server.sessions_authenticated == NUM_HONEST_ATTEMPTS
    assert server.sessions_failed == 0
    assert server.unauthenticated_sessions <= server.max_unauthenticated
    # every stranger beyond max_unauthenticated was dropped to make room, none refused
    assert server.sessions_evicted >= NUM_STRANGERS - server.max_unauthenticated
    assert server.sessions_refused == 0
    # a debug line per drop, and only a summary now and then at warning level: no log flood
    assert len(netproto_warnings(caplog)) < 10


def test_server_survives_failing_to_start_a_session_thread(start_server, monkeypatch) -> None:
    server = start_server(secret=SECRET)
    real_start = threading.Thread.start
    failures = [1]

    def start_or_fail(thread: threading.Thread) -> None:
        if thread.name.endswith("-session") and failures:
            failures.pop()
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    with socket.create_connection(server.address) as sock:
        sock.sendall(CHALLENGE)  # a session's thread starts with its client's first bytes
        assert closed_by_peer(sock)  # refused, not left hanging
    assert server.sessions_refused == 1
    with Connection.connect(*server.address, secret=SECRET) as conn:  # the next one is served
        conn.ping()


def test_accept_loop_survives_running_out_of_file_descriptors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class ListenerOutOfFiles(socket.socket):
        """Fails its first accept as a process with no file descriptor left would."""

        failures = 2

        def accept(self) -> tuple[socket.socket, object]:
            if ListenerOutOfFiles.failures:
                ListenerOutOfFiles.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return super().accept()

    listener = ListenerOutOfFiles(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    accepted: list[socket.socket] = []
    stopping = StopSignal()
    loop = threading.Thread(target=accept_until, args=(listener, stopping, accepted.append))
    with caplog.at_level(logging.WARNING, logger="netproto"):
        loop.start()
        try:
            with socket.create_connection(listener.getsockname()):
                assert wait_for(lambda: len(accepted) == 1)
        finally:
            stopping.set()
            loop.join(timeout=30)
            listener.close()
            stopping.close()
            for sock in accepted:
                sock.close()
    assert not loop.is_alive()
    assert ListenerOutOfFiles.failures == 0
    assert len(netproto_warnings(caplog)) == 1  # said once, not once per retry


def test_an_accept_loop_stopped_before_it_began_returns_quietly() -> None:
    """A server stopped at once after its start (its listener closed before its accept thread
    registered it) ends that thread without an error; a closed listener while it is not
    stopping is still an error. (A fresh clone's run once caught the link emulator's accept
    thread raising there: ValueError, invalid file descriptor.)"""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.close()
    stopping = StopSignal()
    try:
        with pytest.raises(ValueError, match="file descriptor"):
            accept_until(listener, stopping, lambda sock: None)
        stopping.set()
        accept_until(listener, stopping, lambda sock: None)  # returns: nothing to report
    finally:
        stopping.close()


# ------------------------------------------------------------------ one log line


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b'{"a":' + b"[" * 1500 + b"]" * 1500 + b"}", id="json-1500-deep"),
        pytest.param(b'{"t":1e999}', id="json-infinite-number"),
    ],
)
def test_decode_failure_before_auth_is_one_log_line_without_traceback(
    start_server, caplog: pytest.LogCaptureFixture, payload: bytes
) -> None:
    server = start_server(secret=SECRET)
    header = HEADER.pack(
        MAGIC, PROTOCOL_VERSION, 0, MsgType.DATA_JSON, PayloadKind.JSON, 0, len(payload)
    )
    with caplog.at_level(logging.DEBUG, logger="netproto"):
        with socket.create_connection(server.address) as sock:
            sock.sendall(header + payload)
            reply = read_message(sock)
            assert reply is not None and reply.payload["code"] == "protocol_error"
            assert closed_by_peer(sock)
        assert wait_for(lambda: server.sessions_failed == 1)
    lines = netproto_warnings(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None and "\n" not in lines[0].getMessage()
    assert "bad JSON" in lines[0].getMessage()
