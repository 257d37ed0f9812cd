"""Shared-secret handshake: accepted with the secret, refused without, on replay, and TLS."""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import threading
from pathlib import Path

import pytest

from netproto import (
    AuthenticationError,
    Connection,
    MsgType,
    RemoteError,
    client_ssl_context,
    server_ssl_context,
)
from netproto.codecs import encode_bytes as frame
from netproto.header import HEADER, MAGIC, PROTOCOL_VERSION, Message, PayloadKind
from netproto.wire import FrameDecoder
from tests.clocks import HANG_GUARD_S

from .conftest import wait_for

SECRET = b"correct horse battery staple"


def test_client_with_the_secret_is_accepted(start_server) -> None:
    server = start_server(secret=SECRET)
    with Connection.connect(*server.address, secret=SECRET) as conn:
        assert conn.request(MsgType.DATA_JSON, {"hi": 1}, expect=MsgType.DATA_JSON).payload == {
            "hi": 1
        }


def test_client_without_the_secret_is_refused_before_any_message_is_read(start_server) -> None:
    seen: list[Message] = []

    def recording_handler(conn: Connection) -> None:
        seen.append(conn.recv())

    server = start_server(recording_handler, secret=SECRET)
    with (
        Connection.connect(*server.address) as conn,
        pytest.raises(RemoteError, match="auth_required"),
    ):
        conn.request(MsgType.DATA_JSON, {"sneaky": True}, expect=MsgType.DATA_JSON)
    assert seen == []
    assert wait_for(lambda: server.sessions_failed == 1)


def test_wrong_secret_is_refused_and_counted_on_both_sides(start_server) -> None:
    """The client sees the server's wrong proof first and hangs up; the server counts a failed
    handshake all the same (a run waiting for its peers can then say a secret differs)."""
    server = start_server(secret=SECRET)
    with pytest.raises(AuthenticationError, match="shared secret differs from ours"):
        Connection.connect(*server.address, secret=b"wrong")
    assert wait_for(lambda: server.handshakes_failed == 1)
    with Connection.connect(*server.address, secret=SECRET):
        pass
    assert server.handshakes_failed == 1


def test_secret_on_one_side_only_says_so(start_server) -> None:
    server = start_server()
    with pytest.raises(AuthenticationError, match="no shared secret configured"):
        Connection.connect(*server.address, secret=SECRET)


def _mac(label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(SECRET, label + first + second, hashlib.sha256).digest()


def _read_message(sock: socket.socket) -> Message:
    decoder = FrameDecoder()
    while True:
        data = sock.recv(4096)
        assert data, "server closed the connection"
        decoder.feed(data)
        if (message := decoder.next_message()) is not None:
            return message


def test_replayed_handshake_is_refused(start_server) -> None:
    server = start_server(secret=SECRET)
    nonce_c = b"\x01" * 32
    challenge = frame(Message(MsgType.AUTH_CHALLENGE, nonce_c))
    # A legitimate session, recorded by an eavesdropper.
    with socket.create_connection(server.address) as sock:
        sock.sendall(challenge)
        nonce_s = _read_message(sock).payload[:32]
        proof = frame(Message(MsgType.AUTH_PROOF, _mac(b"cli", nonce_s, nonce_c)))
        sock.sendall(proof)
        assert _read_message(sock).type == MsgType.AUTH_OK
    # The same bytes replayed on a new connection: the server's fresh nonce makes them useless.
    with socket.create_connection(server.address) as sock:
        sock.sendall(challenge)
        fresh_nonce = _read_message(sock).payload[:32]
        assert fresh_nonce != nonce_s
        sock.sendall(proof)
        reply = _read_message(sock)
        assert reply.type == MsgType.ERROR and reply.payload["code"] == "auth_failed"


def test_client_never_proves_itself_to_an_impostor_server() -> None:
    received = bytearray()
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            received.extend(conn.recv(4096))
            conn.sendall(frame(Message(MsgType.AUTH_RESPONSE, b"\x00" * 64)))
            conn.settimeout(2)
            try:
                while data := conn.recv(4096):
                    received.extend(data)
            except (TimeoutError, OSError):
                pass

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(AuthenticationError, match=r"server's shared secret differs from ours"):
        Connection.connect(*listener.getsockname(), secret=SECRET)
    thread.join()
    listener.close()
    decoder = FrameDecoder()
    decoder.feed(bytes(received))
    assert MsgType.AUTH_PROOF not in [m.type for m in decoder]


def test_unauthenticated_peer_cannot_make_the_server_allocate(start_server) -> None:
    server = start_server(secret=SECRET)
    with socket.create_connection(server.address) as sock:
        sock.sendall(
            HEADER.pack(
                MAGIC,
                PROTOCOL_VERSION,
                0,
                MsgType.AUTH_CHALLENGE,
                PayloadKind.BYTES,
                0,
                200 * 2**20,
            )
        )
        sock.settimeout(HANG_GUARD_S)
        reply = _read_message(sock)  # refused from the header alone, before any allocation
        assert sock.recv(65536) == b""
    assert reply.type == MsgType.ERROR
    assert "exceeds the cap of 4096" in reply.payload["message"]
    assert wait_for(lambda: server.sessions_failed == 1)


def test_tls_with_auth_round_trips(start_server, certificate: tuple[str, str]) -> None:
    cert, key = certificate
    server = start_server(secret=SECRET, ssl_context=server_ssl_context(cert=cert, key=key))
    with Connection.connect(
        *server.address, secret=SECRET, ssl_context=client_ssl_context(ca=cert)
    ) as conn:
        assert (
            conn.request(MsgType.DATA_BYTES, b"x" * 100_000, expect=MsgType.DATA_BYTES).payload
            == b"x" * 100_000
        )


def test_tls_client_refuses_an_unknown_certificate(
    start_server, certificate: tuple[str, str], tmp_path: Path
) -> None:
    cert, key = certificate
    server = start_server(ssl_context=server_ssl_context(cert=cert, key=key))
    with pytest.raises(ssl.SSLCertVerificationError):
        Connection.connect(*server.address, ssl_context=client_ssl_context(ca=None))
