"""Live connections: concurrent sessions, timeouts, failures that close one connection only."""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time

import pytest
import torch

import netproto.server
from netproto import (
    Connection,
    ConnectionClosed,
    Limits,
    LocalProtocolError,
    MsgType,
    NetTimeout,
    PeerProtocolError,
    RemoteError,
)
from netproto.codecs import encode_bytes
from netproto.header import DTYPE_CODES, HEADER, MAGIC, PROTOCOL_VERSION, Message, PayloadKind
from tests.clocks import HANG_GUARD_S

from .conftest import echo_handler, wait_for

SECRET = b"correct horse battery staple"


def test_typed_helpers_round_trip_through_a_server(start_server) -> None:
    server = start_server()
    with Connection.connect(*server.address) as conn:
        assert conn.request(MsgType.DATA_JSON, {"a": [1, 2]}, expect=MsgType.DATA_JSON).payload == {
            "a": [1, 2]
        }
        conn.send_tokens(MsgType.DATA_TOKENS, [1, 2, 3])
        assert conn.recv_tokens(MsgType.DATA_TOKENS).tolist() == [1, 2, 3]
        adapter = {"lora_A": torch.randn(8, 64), "lora_B": torch.zeros(64, 8, dtype=torch.bfloat16)}
        conn.send_tensors(MsgType.DATA_TENSORS, adapter)
        received = conn.recv_tensors(MsgType.DATA_TENSORS)
        assert all(torch.equal(received[k], v) for k, v in adapter.items())
        conn.ping()
        assert conn.bytes_sent == conn.bytes_received > 0


def test_typed_helper_refuses_a_type_of_another_kind(start_server) -> None:
    server = start_server()
    with (
        Connection.connect(*server.address) as conn,
        pytest.raises(LocalProtocolError, match="send_tokens cannot send DATA_JSON"),
    ):
        conn.send_tokens(MsgType.DATA_JSON, [1])


def test_large_tensor_arrives_intact(start_server) -> None:
    server = start_server()
    big = torch.randn(16 * 2**20)  # 64 MiB: many partial sendmsg calls
    with Connection.connect(*server.address) as conn:
        conn.send_tensor(MsgType.DATA_TENSOR, big)
        assert torch.equal(conn.recv_tensor(MsgType.DATA_TENSOR), big)


def test_many_concurrent_sessions_each_keep_their_own_state(start_server) -> None:
    def counting_handler(conn: Connection) -> None:
        seen = 0  # per-session state
        while True:
            message = conn.recv(expect=MsgType.DATA_JSON)
            seen += 1
            conn.send_msg(
                MsgType.DATA_JSON,
                {"client": message.payload["client"], "seen": seen},
                request_id=message.request_id,
            )

    server = start_server(counting_handler)
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            with Connection.connect(*server.address) as conn:
                for step in range(1, 31):
                    reply = conn.request(
                        MsgType.DATA_JSON, {"client": index}, expect=MsgType.DATA_JSON
                    ).payload
                    assert reply == {"client": index, "seen": step}
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert server.sessions_started == 12


def test_read_timeout_fires_and_the_connection_stays_usable(start_server) -> None:
    released = threading.Event()

    def held_handler(conn: Connection) -> None:
        while True:
            message = conn.recv()
            released.wait(HANG_GUARD_S)  # the reply goes once the test saw its timeout, not
            # after a sleep a stalled test thread could outlast before its recv began
            conn.send_msg(MsgType.DATA_JSON, message.payload, request_id=message.request_id)

    server = start_server(held_handler)
    with Connection.connect(*server.address, read_timeout_s=0.2) as conn:
        conn.send_msg(MsgType.DATA_JSON, {"held": True})
        started = time.monotonic()
        with pytest.raises(NetTimeout):
            conn.recv(expect=MsgType.DATA_JSON)
        assert time.monotonic() - started > 0.15  # a floor: the read waited its 0.2 s
        released.set()
        reply = conn.recv(expect=MsgType.DATA_JSON, timeout_s=HANG_GUARD_S)
        assert reply.payload == {"held": True}


def test_connecting_to_a_closed_port_is_a_clear_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionClosed, match=f"cannot connect to 127.0.0.1:{port}"):
        Connection.connect("127.0.0.1", port, connect_timeout_s=2)


def test_a_server_gone_between_connect_and_tls_is_connection_closed(monkeypatch) -> None:
    """The TCP connect lands in a dying server's backlog, then the server goes (its listener
    closed: the kernel resets the queued connection) before TLS starts: ConnectionClosed,
    which a client dialling again retries (lab.cluster.connect_when_ready), not a raw
    ConnectionResetError that ended a fed_learn client whose coordinator was being restarted."""
    import ssl

    import netproto.connection as connection_module

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    real = socket.create_connection

    def connect_then_server_goes(*args, **kwargs):
        sock = real(*args, **kwargs)
        listener.close()  # never accepted: the queued connection is reset
        deadline = time.monotonic() + HANG_GUARD_S
        while time.monotonic() < deadline:  # until the reset has arrived
            try:
                sock.getpeername()
            except OSError:
                break
            time.sleep(0.01)
        return sock

    monkeypatch.setattr(connection_module.socket, "create_connection", connect_then_server_goes)
    context = ssl.create_default_context()
    with pytest.raises(ConnectionClosed, match=f"127.0.0.1:{port} closed the connection"):
        Connection.connect("127.0.0.1", port, ssl_context=context, connect_timeout_s=5)


def test_peer_vanishing_mid_frame_is_a_truncation_error(start_server) -> None:
    def half_frame_handler(conn: Connection) -> None:
        conn.recv()
        frame = encode_bytes(Message(MsgType.DATA_BYTES, b"x" * 1000))
        conn._sock.sendall(frame[:500])  # then the session ends and the socket closes

    server = start_server(half_frame_handler)
    with Connection.connect(*server.address) as conn:
        conn.send_msg(MsgType.DATA_JSON, {})
        with pytest.raises(PeerProtocolError, match="mid-frame"):
            conn.recv()
        assert conn.closed


def test_malformed_frame_closes_that_connection_only(start_server) -> None:
    server = start_server()
    with Connection.connect(*server.address) as good:
        with socket.create_connection(server.address) as bad:
            bad.sendall(b"GARBAGE" * 10)
            bad.settimeout(HANG_GUARD_S)
            reply = bad.recv(4096)  # the server says why, then closes
            assert b"protocol_error" in reply and b"bad magic" in reply
            with contextlib.suppress(ConnectionResetError):  # our garbage was left unread
                assert bad.recv(4096) == b""
        assert good.request(
            MsgType.DATA_JSON, {"still": "here"}, expect=MsgType.DATA_JSON
        ).payload == {"still": "here"}


def test_oversize_frame_is_refused_before_allocation(start_server) -> None:
    server = start_server(limits=Limits(max_frame_bytes=2**20))
    with (
        Connection.connect(*server.address) as conn,
        pytest.raises(RemoteError, match="exceeds the cap of 1048576"),
    ):
        conn.request(MsgType.DATA_BYTES, b"x" * (2**20 + 1), expect=MsgType.DATA_BYTES)


def test_handler_crash_is_reported_and_the_server_keeps_serving(start_server) -> None:
    def fragile_handler(conn: Connection) -> None:
        message = conn.recv(expect=MsgType.DATA_JSON)
        if message.payload.get("crash"):
            raise KeyError("bug in handler")
        echo_handler(conn)

    server = start_server(fragile_handler)
    with (
        Connection.connect(*server.address) as conn,
        pytest.raises(RemoteError, match=r"internal.*KeyError"),
    ):
        conn.request(MsgType.DATA_JSON, {"crash": True}, expect=MsgType.DATA_JSON)
    with Connection.connect(*server.address) as conn:
        conn.send_msg(MsgType.DATA_JSON, {})
        assert conn.request(MsgType.DATA_JSON, {"x": 1}, expect=MsgType.DATA_JSON).payload == {
            "x": 1
        }


def test_unexpected_message_type_is_a_protocol_error(start_server) -> None:
    server = start_server()
    with Connection.connect(*server.address) as conn:
        conn.send_msg(MsgType.DATA_JSON, {})
        with pytest.raises(PeerProtocolError, match="sent DATA_JSON where DATA_TOKENS"):
            conn.recv(expect=MsgType.DATA_TOKENS)
        assert conn.closed


def test_stopping_the_server_closes_every_session(start_server) -> None:
    server = start_server()
    conns = [Connection.connect(*server.address) for _ in range(3)]
    for conn in conns:
        conn.ping()
    server.stop(timeout_s=HANG_GUARD_S)  # (its 5 s default join could lapse on a busy machine)
    for conn in conns:
        with pytest.raises((ConnectionClosed, PeerProtocolError)):
            conn.ping(timeout_s=HANG_GUARD_S)
    assert server.active_sessions == 0


def test_an_idle_accept_loop_blocks_until_a_deadline_or_stop(start_server, monkeypatch) -> None:
    """No polling: with no silent connection waiting, the accept loop's selector waits with
    no timeout; with one, until its handshake deadline; `stop` still ends the loop."""
    timeouts: list[float | None] = []

    class Recording(selectors.DefaultSelector):
        def select(self, timeout: float | None = None) -> list:
            timeouts.append(timeout)
            return super().select(timeout)

    monkeypatch.setattr(netproto.server.selectors, "DefaultSelector", Recording)
    server = start_server()
    with Connection.connect(*server.address) as conn:
        conn.ping()
    assert wait_for(lambda: len(timeouts) >= 2)  # it went round after the connection
    assert all(t is None for t in timeouts)
    server.stop()
    assert server._accept_thread is not None and not server._accept_thread.is_alive()

    timeouts.clear()
    secured = start_server(secret=SECRET, handshake_timeout_s=HANG_GUARD_S)
    with socket.create_connection(secured.address):  # connected, silent: awaited
        assert wait_for(lambda: bool(timeouts) and timeouts[-1] is not None)
        last = timeouts[-1]
        assert last is not None and 0 < last <= HANG_GUARD_S


def test_a_frame_encoded_once_is_sent_as_send_sends_it() -> None:
    """A broadcast (`encode` once, `send_encoded` to every peer): byte for byte what `send`
    sends, on every connection, and a snapshot of the tensors it was encoded from."""
    adapter = {"lora_A": torch.randn(8, 64), "lora_B": torch.zeros(64, 8, dtype=torch.bfloat16)}
    pairs = []
    for _ in range(2):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            ours = socket.create_connection(listener.getsockname())
            pairs.append((ours, listener.accept()[0]))
    conns = [Connection(ours, read_timeout_s=HANG_GUARD_S) for ours, _ in pairs]

    def read(peer: socket.socket, size: int) -> bytes:
        peer.settimeout(HANG_GUARD_S)
        data = b""
        while len(data) < size:
            data += peer.recv(size - len(data))
        return data

    try:
        size = conns[0].send_tensors(MsgType.DATA_TENSORS, adapter)
        sent = read(pairs[0][1], size)
        frame = conns[0].encode(MsgType.DATA_TENSORS, adapter)
        adapter["lora_A"] += 1.0  # changed after encoding: the frame is not
        for conn, (_, peer) in zip(conns, pairs, strict=True):
            assert conn.send_encoded(frame) == frame.size == size
            assert read(peer, size) == sent
        assert conns[1].bytes_sent == size
        other = Connection(pairs[1][0], limits=Limits(max_frame_bytes=2**20))
        with pytest.raises(LocalProtocolError, match="other limits"):
            other.send_encoded(frame)  # checked against limits that are not its own
        assert other.bytes_sent == 0
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_receiver_checks_an_encoded_frame_as_any_other(start_server) -> None:
    server = start_server(limits=Limits(max_frame_bytes=2**20))
    small = {"w": torch.arange(6.0).reshape(2, 3)}
    with Connection.connect(*server.address) as conn:
        conn.send_encoded(conn.encode(MsgType.DATA_TENSORS, small))
        assert torch.equal(conn.recv_tensors(MsgType.DATA_TENSORS)["w"], small["w"])
        conn.send_encoded(conn.encode(MsgType.DATA_TENSORS, {"w": torch.zeros(2**18 + 1)}))
        with pytest.raises(RemoteError, match="exceeds the cap of 1048576"):
            conn.recv(expect=MsgType.DATA_TENSORS)  # over the server's cap: refused
    with (
        Connection.connect(*server.address, limits=Limits(max_frame_bytes=2**20)) as conn,
        pytest.raises(LocalProtocolError, match="exceeds max_frame_bytes"),
    ):
        conn.encode(MsgType.DATA_TENSORS, {"w": torch.zeros(2**18 + 1)})  # as send refuses it


def test_close_is_clean_and_idempotent(start_server) -> None:
    server = start_server()
    conn = Connection.connect(*server.address)
    conn.close()
    conn.close()
    with pytest.raises(ConnectionClosed):
        conn.send_msg(MsgType.DATA_JSON, {})
    assert wait_for(lambda: server.active_sessions == 0, timeout_s=HANG_GUARD_S)


def test_big_receive_buffer_is_reused_only_once_nothing_holds_it(start_server) -> None:
    server = start_server()
    with Connection.connect(*server.address) as conn:
        first = torch.full((2**19,), 1.0)  # 2 MiB: big enough for the reusable buffer
        conn.send_tensor(MsgType.DATA_TENSOR, first)
        kept = conn.recv_tensor(MsgType.DATA_TENSOR)
        kept_ptr = kept.data_ptr()
        conn.send_tensor(MsgType.DATA_TENSOR, torch.full((2**19,), 2.0))
        second = conn.recv_tensor(MsgType.DATA_TENSOR)
        assert torch.equal(kept, first)  # still held: never overwritten
        assert second.data_ptr() != kept_ptr
        second_ptr = second.data_ptr()
        del kept, second
        conn.send_tensor(MsgType.DATA_TENSOR, torch.full((2**19,), 3.0))
        third = conn.recv_tensor(MsgType.DATA_TENSOR)
        assert torch.equal(third, torch.full((2**19,), 3.0))
        assert third.data_ptr() == second_ptr  # dropped: its buffer came back


def test_a_small_frame_held_never_pins_a_big_receive_buffer(start_server) -> None:
    """A peer's one huge frame, dropped, then a small one that is kept (a client's update): the
    small one must not land in the huge spare and keep it alive for as long as it is held; a
    frame at least half a spare's size still reuses it."""
    server = start_server()
    with Connection.connect(*server.address) as conn:
        conn.send_tensor(MsgType.DATA_TENSOR, torch.zeros(2**21))  # 8 MiB, dropped
        huge_ptr = conn.recv_tensor(MsgType.DATA_TENSOR).data_ptr()
        small = torch.full((2**19,), 4.0)  # 2 MiB
        conn.send_tensor(MsgType.DATA_TENSOR, small)
        held = conn.recv_tensor(MsgType.DATA_TENSOR)
        assert torch.equal(held, small)
        assert held.untyped_storage().nbytes() <= 2 * held.nbytes
        conn.send_tensor(MsgType.DATA_TENSOR, torch.full((3 * 2**19,), 5.0))  # 6 MiB
        assert conn.recv_tensor(MsgType.DATA_TENSOR).data_ptr() == huge_ptr


# ------------------------------------------------------------------ what reaches the log


def netproto_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name.startswith("netproto") and r.levelno >= logging.WARNING
    ]


def test_error_frame_with_newlines_cannot_forge_a_log_line(
    start_server, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(secret=SECRET)
    forged = "bye\n2026-01-01 00:00:00 CRITICAL root: disk on fire\r\x1b[2K"
    with caplog.at_level(logging.DEBUG, logger="netproto"):
        with Connection.connect(*server.address, secret=SECRET) as conn:
            conn.send(MsgType.ERROR, {"code": "x\ny", "message": forged})
        assert wait_for(lambda: server.sessions_failed == 1)
    [line] = netproto_warnings(caplog)
    text = line.getMessage()
    assert "\n" not in text and "\r" not in text and "\x1b" not in text
    assert "[x\\ny]" in text and "bye\\n2026-01-01 00:00:00 CRITICAL" in text
    assert all(r.levelno < logging.CRITICAL for r in caplog.records)


def test_remote_error_keeps_the_peers_text_escaped_and_capped() -> None:
    error = RemoteError("bad\ncode" * 100, "line one\nline two\t\u2028" * 1000)
    assert error.code.startswith("bad\\ncode") and len(error.code) <= 103
    assert error.message.startswith("line one\\nline two\\t\\u2028")
    assert len(error.message) <= 2003 and error.message.endswith("...")
    assert str(error).isprintable()
    plain = RemoteError("bad_request", "temperature must be finite: ünïcode is fine")
    assert plain.message == "temperature must be finite: ünïcode is fine"


@pytest.mark.parametrize(
    ("sent", "taken"),
    [
        (2.5, 2.5),
        (0, 0.0),
        (3600, 3600.0),
        (None, None),
        (True, None),  # a bool is not a number of seconds
        (-1.0, None),
        (3600.5, None),  # past MAX_RETRY_AFTER_S: the peer cannot park a client for good
        (10**400, None),  # past a float's range: refused before any conversion
        ("5", None),
        ([1], None),
    ],
)
def test_an_errors_retry_after_is_taken_only_as_a_bounded_number_of_seconds(
    start_server, sent: object, taken: float | None
) -> None:
    def refuse(conn: Connection) -> None:
        conn.recv()
        body: dict[str, object] = {"code": "rate_limited", "message": "later"}
        if sent is not None:
            body["retry_after_s"] = sent
        conn.send(MsgType.ERROR, body)

    server = start_server(refuse)
    with Connection.connect(*server.address) as conn, pytest.raises(RemoteError) as caught:
        conn.request(MsgType.DATA_JSON, {}, expect=MsgType.DATA_JSON)
    assert caught.value.code == "rate_limited"
    assert caught.value.retry_after_s == taken


def test_send_error_carries_retry_after_to_the_peer(start_server) -> None:
    def refuse(conn: Connection) -> None:
        request = conn.recv()
        conn.send_error("rate_limited", "later", request_id=request.request_id, retry_after_s=1.5)

    server = start_server(refuse)
    with Connection.connect(*server.address) as conn, pytest.raises(RemoteError) as caught:
        conn.request(MsgType.DATA_JSON, {}, expect=MsgType.DATA_JSON)
    assert caught.value.retry_after_s == 1.5
    assert RemoteError("internal", "no field").retry_after_s is None


def _json_frame(body: bytes) -> bytes:
    return (
        HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, MsgType.DATA_JSON, PayloadKind.JSON, 5, len(body))
        + body
    )


def _tensor_frame(shape: list[int]) -> bytes:
    meta = struct.pack(f"!BB{len(shape)}Q", DTYPE_CODES[torch.float32], len(shape), *shape)
    payload = meta + bytes(-len(meta) % 16)
    return (
        HEADER.pack(
            MAGIC, PROTOCOL_VERSION, 0, MsgType.DATA_TENSOR, PayloadKind.TENSOR, 5, len(payload)
        )
        + payload
    )


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        pytest.param(_tensor_frame([0] + [2**28] * 7), "exceeds the frame cap", id="stride"),
        pytest.param(
            _json_frame(b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"), "nested", id="deep-json"
        ),
        pytest.param(_json_frame(b'{"a":' + b"9" * 5000 + b"}"), "digits", id="huge-int"),
        pytest.param(_json_frame(b'{"a":-1e999}'), "not finite", id="infinite-float"),
    ],
)
def test_decode_failure_after_auth_is_protocol_error_and_one_log_line(
    start_server, caplog: pytest.LogCaptureFixture, frame: bytes, reason: str
) -> None:
    server = start_server(secret=SECRET)
    with caplog.at_level(logging.DEBUG, logger="netproto"):
        with Connection.connect(*server.address, secret=SECRET) as conn:
            conn._sock.sendall(frame)
            with pytest.raises(RemoteError, match=rf"\[protocol_error\].*{reason}"):
                conn.recv()
        assert wait_for(lambda: server.sessions_failed == 1)
    [line] = netproto_warnings(caplog)
    assert line.exc_info is None and "\n" not in line.getMessage()
    assert reason in line.getMessage()
    with Connection.connect(*server.address, secret=SECRET) as conn:  # and it keeps serving
        conn.ping()


def test_a_refused_peer_that_kept_sending_reads_why_not_a_reset(start_server) -> None:
    """A peer's frames may follow the one refused (a pipelined drafter's drafts follow its
    OPEN unanswered). Closed with them unread, the server's socket would answer with a TCP
    reset, and the peer's next send would fail as 'connection lost' before it read the ERROR
    saying why. The refused session lingers instead: the peer sends on, then reads the
    refusal, then the goodbye."""

    def refuse_the_first(conn: Connection) -> None:
        conn.recv(expect=MsgType.DATA_JSON)
        conn.send_error("bad_request", "the first message is refused")
        raise PeerProtocolError("refused")

    server = start_server(refuse_the_first, refusal_linger_s=HANG_GUARD_S)
    with Connection.connect(*server.address) as conn:
        conn.send_msg(MsgType.DATA_JSON, {"n": 1})
        conn.send_msg(MsgType.DATA_JSON, {"n": 2})  # unread by the server when it refuses
        assert wait_for(lambda: server.sessions_failed == 1)  # the refusal is made and sent
        for n in range(3, 6):
            conn.send_msg(MsgType.DATA_JSON, {"n": n, "pad": "x" * 1000})  # sent on
        with pytest.raises(RemoteError, match="the first message is refused"):
            conn.recv(expect=MsgType.DATA_JSON)
        with pytest.raises(ConnectionClosed, match="closed the connection"):
            conn.recv(expect=MsgType.DATA_JSON)  # the goodbye after the ERROR
    assert wait_for(lambda: server.active_sessions == 0)  # our close ended its linger
