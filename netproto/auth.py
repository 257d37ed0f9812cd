"""Shared-secret authentication: HMAC-SHA256 challenge-response, both ways.

    client -> server  AUTH_CHALLENGE  nonce_c (32 random bytes)
    server -> client  AUTH_RESPONSE   nonce_s || HMAC(secret, "srv" || nonce_c || nonce_s)
    client -> server  AUTH_PROOF      HMAC(secret, "cli" || nonce_s || nonce_c)
    server -> client  AUTH_OK

The client checks the server's MAC before proving itself (no impostor server learns a proof),
the server checks the client's MAC before reading any other message, both compare in constant
time, and the fresh server nonce makes a recorded proof useless on a new connection (replay).
Unauthenticated frames are capped at AUTH_LIMITS (4 KiB), so a stranger cannot make the server
allocate anything big. This authenticates the peers; for confidentiality add TLS.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any, Protocol

from netproto.errors import AuthenticationError, ConnectionClosed, PeerProtocolError, RemoteError
from netproto.header import MsgType


class Connection(Protocol):
    """What the handshake needs of a connection (netproto.connection.Connection, which calls
    it: a structural type, so this module does not import the one that imports it)."""

    def send(self, msg_type: int, payload: Any = None) -> int: ...

    def recv(self, *, expect: int | None = None) -> Any: ...

    def send_error(self, code: str, message: str) -> None: ...


NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size


def mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of `label` followed by `parts` (the label keeps one proof from passing for
    another role's)."""
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def client_handshake(conn: Connection, secret: bytes) -> None:
    """Prove we know `secret` and check that the server does too."""
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    conn.send(MsgType.AUTH_CHALLENGE, nonce_c)
    try:
        reply = conn.recv(expect=MsgType.AUTH_RESPONSE).payload
    except RemoteError as exc:
        raise AuthenticationError(f"server refused the handshake: {exc.message}") from None
    except PeerProtocolError as exc:
        raise AuthenticationError(f"bad handshake reply from server: {exc}") from None
    if len(reply) != NONCE_BYTES + MAC_BYTES:
        raise AuthenticationError("server's handshake reply has the wrong length")
    nonce_s, server_mac = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(server_mac, mac(secret, b"srv", nonce_c, nonce_s)):
        raise AuthenticationError(
            "the server's shared secret differs from ours (cluster.secret / LAB_SECRET must be "
            "the same on both sides)"
        )
    conn.send(MsgType.AUTH_PROOF, mac(secret, b"cli", nonce_s, nonce_c))
    try:
        conn.recv(expect=MsgType.AUTH_OK)
    except RemoteError as exc:
        raise AuthenticationError(f"server refused our proof: {exc.message}") from None


def server_handshake(conn: Connection, secret: bytes) -> None:
    """Refuse the peer unless it proves it knows `secret`; the first frame must be the challenge."""
    try:
        first = conn.recv()
    except PeerProtocolError as exc:
        raise AuthenticationError(f"unauthenticated peer sent a bad frame: {exc}") from None
    if first.type != MsgType.AUTH_CHALLENGE:
        conn.send_error(
            "auth_required",
            "this server requires the shared secret (set cluster.secret or LAB_SECRET)",
        )
        raise AuthenticationError(f"peer sent {first.type:#06x} before authenticating")
    nonce_c = first.payload
    if len(nonce_c) != NONCE_BYTES:
        raise AuthenticationError("peer's challenge has the wrong length")
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    conn.send(MsgType.AUTH_RESPONSE, nonce_s + mac(secret, b"srv", nonce_c, nonce_s))
    try:
        proof = conn.recv(expect=MsgType.AUTH_PROOF).payload
    except PeerProtocolError as exc:
        raise AuthenticationError(f"peer broke the handshake: {exc}") from None
    except ConnectionClosed:  # the client checks our proof first: it hangs up on a wrong one
        raise AuthenticationError(
            "peer left after our handshake reply: its shared secret differs from ours, most "
            "likely (or it was no client of this run)"
        ) from None
    if not hmac.compare_digest(proof, mac(secret, b"cli", nonce_s, nonce_c)):
        conn.send_error("auth_failed", "wrong shared secret")
        raise AuthenticationError(
            "peer's shared secret differs from ours (cluster.secret / LAB_SECRET must be the "
            "same on both sides)"
        )
    conn.send(MsgType.AUTH_OK, None)
