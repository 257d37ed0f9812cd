"""A blocking netproto connection: typed send/recv over one TCP (optionally TLS) socket.

Large payloads go out with one scatter-gather `sendmsg` of header + memoryviews of the tensor
storage (no join, no copy) and come in with `recv_into` a buffer allocated only after the
header's length has passed the frame cap. Tensors received are views into that buffer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from netproto import auth
from netproto.errors import (
    ConnectionClosed,
    LocalProtocolError,
    NetTimeout,
    PeerProtocolError,
    RemoteError,
    peer_text,
)
from netproto.wire import (
    AUTH_LIMITS,
    HEADER_BYTES,
    REGISTRY,
    Buffer,
    Limits,
    Message,
    MsgType,
    PayloadKind,
    Registry,
    decode_payload,
    encode,
    new_payload_buffer,
    parse_header,
)

log = logging.getLogger(__name__)

IOV_MAX = 1024
READ_CHUNK_BYTES = 64 * 1024
"""Frames up to this size arrive through one buffered read (header and payload together)."""
SMALL_SEND_BYTES = 64 * 1024
"""Frames up to this size are joined and sent with one sendall."""
REUSE_MIN_BYTES = 1 << 20
"""Payloads this big are received into a buffer reused across frames once nothing uses it."""
NUM_SPARE_BUFFERS = 2


def _storage_refs(tensor: torch.Tensor) -> int | None:
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:  # not in this torch: never reuse
        return None
    return int(counter(tensor.untyped_storage()._cdata))


_UNSHARED_REFS = _storage_refs(torch.empty(1))
"""Storage references of a tensor nobody else views (the tensor, plus the probe's own)."""
_AUTH_TYPES = frozenset(
    {MsgType.AUTH_CHALLENGE, MsgType.AUTH_RESPONSE, MsgType.AUTH_PROOF, MsgType.AUTH_OK}
)
_UNSET: Any = object()


def client_ssl_context(
    *, ca: str | None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """Verify the server against `ca` (system CAs when None); present cert/key if given."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert and key:
        context.load_cert_chain(cert, key)
    return context


def server_ssl_context(*, cert: str, key: str, ca: str | None = None) -> ssl.SSLContext:
    """Serve with cert/key; with `ca`, also require client certificates signed by it."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    context.load_cert_chain(cert, key)
    if ca:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class Connection:
    """One peer. Sending is thread-safe (a heartbeat thread may ping); receive from one thread."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        limits: Limits = Limits(),
        read_timeout_s: float | None = 60.0,
        registry: Registry = REGISTRY,
        peer: str | None = None,
    ) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._limits = limits
        self._active_limits = limits
        self._registry = registry
        self._read_timeout_s = read_timeout_s
        self._send_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._closed = False
        self._in_handshake = False
        self._deadline: float | None = None  # monotonic; set while the handshake runs
        self.peer = peer or _peer_name(sock)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_received = time.monotonic()
        """When the last whole frame arrived (heartbeats included): for liveness checks."""
        self._rbuf = memoryview(bytearray(READ_CHUNK_BYTES))
        self._rpos = 0  # unread bytes are self._rbuf[self._rpos:self._rend]
        self._rend = 0
        self._spares: list[torch.Tensor] = []  # big receive buffers, reused when unshared
        sock.settimeout(read_timeout_s)

    # ------------------------------------------------------------ set-up

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        *,
        secret: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float | None = 60.0,
        limits: Limits = Limits(),
        registry: Registry = REGISTRY,
    ) -> Connection:
        """Connect (TLS when `ssl_context`), authenticate when `secret`, return the connection.

        `connect_timeout_s` bounds all of it together: TCP connect, TLS and the handshake.
        """
        deadline = time.monotonic() + connect_timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        except TimeoutError:
            raise NetTimeout(
                f"connecting to {host}:{port} timed out after {connect_timeout_s}s"
            ) from None
        except OSError as exc:
            raise ConnectionClosed(
                f"cannot connect to {host}:{port}: {exc.strerror or exc}"
            ) from None
        try:
            if ssl_context is not None:
                sock = ssl_context.wrap_socket(
                    sock, server_hostname=server_hostname or host, do_handshake_on_connect=False
                )
            conn = cls(
                sock,
                limits=limits,
                read_timeout_s=read_timeout_s,
                registry=registry,
                peer=f"{host}:{port}",
            )
            conn._establish(secret=secret, server_side=False, deadline=deadline)
            return conn
        except BaseException:
            sock.close()
            raise

    @classmethod
    def accept(
        cls,
        sock: socket.socket,
        *,
        secret: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        handshake_timeout_s: float = 10.0,
        read_timeout_s: float | None = 60.0,
        limits: Limits = Limits(),
        registry: Registry = REGISTRY,
    ) -> Connection:
        """Server side of a freshly accepted socket: TLS, then the handshake when `secret`.

        `handshake_timeout_s` is one deadline for both: a peer sending a byte at a time cannot
        stretch it. (`accepted` + `handshake_as_server`, for a caller that needs the connection
        before the handshake, e.g. to interrupt it.)
        """
        conn = cls.accepted(
            sock,
            ssl_context=ssl_context,
            read_timeout_s=read_timeout_s,
            limits=limits,
            registry=registry,
        )
        try:
            conn.handshake_as_server(secret=secret, timeout_s=handshake_timeout_s)
        except BaseException:
            conn._abort()
            raise
        return conn

    @classmethod
    def accepted(
        cls,
        sock: socket.socket,
        *,
        ssl_context: ssl.SSLContext | None = None,
        read_timeout_s: float | None = 60.0,
        limits: Limits = Limits(),
        registry: Registry = REGISTRY,
    ) -> Connection:
        """A connection over a freshly accepted socket, TLS-wrapped but with no I/O done yet:
        call `handshake_as_server` before anything else."""
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return cls(sock, limits=limits, read_timeout_s=read_timeout_s, registry=registry)

    def handshake_as_server(self, *, secret: bytes | None, timeout_s: float) -> None:
        """TLS's handshake (when TLS), then the shared-secret one (when `secret`), all within
        `timeout_s`. Raises on failure (the caller closes the connection)."""
        self._establish(secret=secret, server_side=True, deadline=time.monotonic() + timeout_s)

    def _establish(self, *, secret: bytes | None, server_side: bool, deadline: float) -> None:
        """Run the handshakes before `deadline`; until they are done the peer is a stranger:
        frames capped at AUTH_LIMITS, no pings answered, nothing but the handshake's frames."""
        self._in_handshake = True
        self._deadline = deadline
        try:
            if isinstance(self._sock, ssl.SSLSocket):
                self._arm_deadline()
                try:
                    # CPython counts the socket timeout as one deadline for the whole call
                    self._sock.do_handshake()
                except TimeoutError:
                    self._abort()
                    raise NetTimeout(
                        f"TLS handshake with {self.peer} did not finish in time"
                    ) from None
            if secret:
                self._active_limits = AUTH_LIMITS  # nothing bigger than a handshake frame
                if server_side:
                    auth.server_handshake(self, secret)
                else:
                    auth.client_handshake(self, secret)
                self._active_limits = self._limits
        finally:
            self._in_handshake = False
            self._deadline = None
        self._sock.settimeout(self._read_timeout_s)

    def _arm_deadline(self) -> None:
        """During the handshake: the next socket call may wait only for the time left."""
        assert self._deadline is not None
        left = self._deadline - time.monotonic()
        if left <= 0:
            self._abort()
            raise NetTimeout(f"handshake with {self.peer} did not finish in time")
        self._sock.settimeout(left)

    # ------------------------------------------------------------ sending

    def send(
        self, msg_type: int, payload: Any = None, *, request_id: int = 0, flags: int = 0
    ) -> int:
        """Send one message; the payload's encoding follows the type's registered kind.

        Returns the frame's size in bytes. LocalProtocolError (nothing sent) when the payload
        does not fit the type or the limits.
        """
        buffers = encode(
            Message(msg_type, payload, request_id, flags),
            limits=self._limits,
            registry=self._registry,
        )
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed(f"connection to {self.peer} is closed")
            if self._deadline is not None:
                self._arm_deadline()
            try:
                sent = self._sendall(buffers)
            except OSError as exc:  # a half-sent frame cannot be taken back: close
                raise self._lost(exc, mid_frame=True) from None
        self.bytes_sent += sent
        return sent

    def _sendall(self, buffers: Sequence[Buffer]) -> int:
        views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
        total = sum(v.nbytes for v in views)
        if total <= SMALL_SEND_BYTES:
            self._sock.sendall(b"".join(views))
            return total
        if isinstance(self._sock, ssl.SSLSocket):  # no sendmsg over TLS
            for view in views:
                self._sock.sendall(view)
            return total
        first = 0
        while first < len(views):
            sent = self._sock.sendmsg(views[first : first + IOV_MAX])
            while sent:
                size = views[first].nbytes
                if sent >= size:
                    sent -= size
                    first += 1
                else:
                    views[first] = views[first][sent:]
                    sent = 0
        return total

    def _check_kind(self, msg_type: int, kind: PayloadKind, method: str) -> None:
        spec = self._registry.spec(msg_type)
        if spec is not None and spec.kind != kind:
            raise LocalProtocolError(
                f"{method} cannot send {spec.name}, which carries {spec.kind.name}"
            )

    def send_msg(
        self, msg_type: int, body: Mapping[str, Any] | None = None, *, request_id: int = 0
    ) -> int:
        """A small control message (a JSON object)."""
        self._check_kind(msg_type, PayloadKind.JSON, "send_msg")
        return self.send(msg_type, dict(body or {}), request_id=request_id)

    def send_tokens(
        self, msg_type: int, tokens: Sequence[int] | torch.Tensor, *, request_id: int = 0
    ) -> int:
        self._check_kind(msg_type, PayloadKind.TOKENS, "send_tokens")
        return self.send(msg_type, tokens, request_id=request_id)

    def send_tensor(self, msg_type: int, tensor: torch.Tensor, *, request_id: int = 0) -> int:
        self._check_kind(msg_type, PayloadKind.TENSOR, "send_tensor")
        return self.send(msg_type, tensor, request_id=request_id)

    def send_tensors(
        self, msg_type: int, tensors: Mapping[str, torch.Tensor], *, request_id: int = 0
    ) -> int:
        self._check_kind(msg_type, PayloadKind.TENSORS, "send_tensors")
        return self.send(msg_type, tensors, request_id=request_id)

    def send_error(self, code: str, message: str, *, request_id: int = 0) -> None:
        """Tell the peer why we refuse or fail; best effort (the peer may be gone)."""
        with contextlib.suppress(Exception):
            self.send(
                MsgType.ERROR, {"code": code, "message": message[:2000]}, request_id=request_id
            )

    def next_request_id(self) -> int:
        return next(self._request_ids) % (2**32 - 1) + 1  # 0 means 'not a request'

    # ------------------------------------------------------------ receiving

    def recv(
        self, *, expect: int | Collection[int] | None = None, timeout_s: float | None = _UNSET
    ) -> Message:
        """The next message. Answers PINGs by itself; an ERROR from the peer raises RemoteError.

        During the handshake nothing is handled by itself: a frame the handshake does not
        expect ends it (no PING keeps a stranger connected).

        `expect`: the type(s) the caller can handle; anything else is the peer breaking the
        protocol (PeerProtocolError, connection closed). `timeout_s` overrides the read timeout
        for this call; NetTimeout when nothing arrives in time (the connection stays usable if
        no byte of a frame had arrived).
        """
        expected = (
            None
            if expect is None
            else ({int(expect)} if isinstance(expect, int) else {int(t) for t in expect})
        )
        if timeout_s is not _UNSET:
            self._sock.settimeout(timeout_s)
        try:
            while True:
                message = self._recv_frame()
                if expected is not None and message.type in expected:
                    return message
                if message.type == MsgType.ERROR:
                    body = message.payload
                    raise RemoteError(str(body.get("code", "error")), str(body.get("message", "")))
                if self._in_handshake:
                    if expected is None:  # the server's first frame: its handshake refuses it
                        return message
                    raise self._fail(
                        PeerProtocolError(
                            f"{self.peer} sent {self._registry.name(message.type)} during the "
                            f"handshake, where {self._expected_names(expected)} was expected"
                        )
                    )
                if message.type == MsgType.PING:
                    self.send(MsgType.PONG, request_id=message.request_id)
                    continue
                if message.type == MsgType.PONG:
                    continue
                if message.type == MsgType.BYE:
                    self._abort()
                    raise ConnectionClosed(f"{self.peer} closed the connection")
                if message.type in _AUTH_TYPES:
                    self.send_error(
                        "auth_not_configured",
                        "this side has no shared secret "
                        "configured; set the same cluster.secret on both sides",
                    )
                    raise self._fail(
                        PeerProtocolError(
                            f"{self.peer} wants to authenticate but no secret is configured here"
                        )
                    )
                if expected is not None:
                    raise self._fail(
                        PeerProtocolError(
                            f"{self.peer} sent {self._registry.name(message.type)} where "
                            f"{self._expected_names(expected)} was expected"
                        )
                    )
                return message
        finally:
            if timeout_s is not _UNSET and not self._closed:
                with contextlib.suppress(OSError):
                    self._sock.settimeout(self._read_timeout_s)

    def _expected_names(self, expected: Collection[int]) -> str:
        return " or ".join(sorted(self._registry.name(t) for t in expected))

    def readable(self, timeout_s: float = 0.0) -> bool:
        """Whether a message has begun to arrive (or the peer closed), waiting up to `timeout_s`.

        Lets one thread interleave work with receiving: `recv` after True does not wait for
        the peer to decide to send, only for the rest of a frame already on its way.
        """
        if self._closed:
            return True  # recv says why
        if self._rend > self._rpos:
            return True
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        return bool(ready)

    def _recv_frame(self) -> Message:
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed")
        self._fill(HEADER_BYTES, started=False)
        try:
            header = parse_header(
                self._rbuf[self._rpos : self._rpos + HEADER_BYTES],
                limits=self._active_limits,
                registry=self._registry,
            )
        except PeerProtocolError as exc:
            raise self._fail(exc) from None
        self._rpos += HEADER_BYTES
        length = header.length
        payload: torch.Tensor | bytes
        if length <= READ_CHUNK_BYTES:
            self._fill(length, started=True)
            payload = bytes(self._rbuf[self._rpos : self._rpos + length])
            self._rpos += length
        else:  # big: straight into its own buffer, after what the read buffer already holds
            payload = self._payload_buffer(length)
            view = payload.numpy().data
            buffered = min(self._rend - self._rpos, length)
            view[:buffered] = self._rbuf[self._rpos : self._rpos + buffered]
            self._rpos += buffered
            self._recv_exactly(view[buffered:])
        self.bytes_received += HEADER_BYTES + length
        self.last_received = time.monotonic()
        try:
            value = decode_payload(header, payload, limits=self._active_limits)
        except PeerProtocolError as exc:
            raise self._fail(exc) from None
        return Message(header.type, value, header.request_id, header.flags)

    def _payload_buffer(self, length: int) -> torch.Tensor:
        """A buffer for a big payload: a spare nobody views any more, else a new one.

        Two spares, because the natural loop `message = conn.recv()` still holds the previous
        message while the next one arrives. Fresh big buffers cost page faults on every frame
        (about as long as the loopback transfer itself at 64 MiB).
        """
        for spare in self._spares:
            if (
                spare.numel() >= length
                and _UNSHARED_REFS is not None
                and _storage_refs(spare) == _UNSHARED_REFS
            ):
                return spare[:length]
        buffer = new_payload_buffer(length)
        if length >= REUSE_MIN_BYTES:
            self._spares = [buffer, *self._spares][:NUM_SPARE_BUFFERS]
        return buffer

    def _fill(self, need: int, *, started: bool) -> None:
        """Make `need` (<= READ_CHUNK_BYTES) unread bytes available in the read buffer."""
        if self._rend - self._rpos >= need:
            return
        if self._rpos:  # move the unread tail to the front
            unread = self._rend - self._rpos
            self._rbuf[:unread] = self._rbuf[self._rpos : self._rend]
            self._rpos, self._rend = 0, unread
        while self._rend < need:
            self._rend += self._recv_some(
                self._rbuf[self._rend :], started=started or self._rend > 0
            )

    def _recv_exactly(self, view: memoryview) -> None:
        """Fill `view` (mid-frame): the bulk path, a tight loop of recv_into calls."""
        got, size, recv_into = 0, view.nbytes, self._sock.recv_into
        try:
            while got < size:
                if self._deadline is not None:
                    self._arm_deadline()
                count = recv_into(view[got:])
                if not count:
                    break
                got += count
        except OSError as exc:
            raise self._lost(exc, mid_frame=True) from None
        if got < size:
            self._abort()
            raise PeerProtocolError(
                f"{self.peer} closed the connection mid-frame (truncated "
                f"payload: {got} of {size} bytes)"
            )

    def _recv_some(self, view: memoryview, *, started: bool) -> int:
        """One recv_into; `started`: bytes of this frame already arrived (EOF = truncation)."""
        if self._deadline is not None:
            self._arm_deadline()
        try:
            count = self._sock.recv_into(view)
        except OSError as exc:
            raise self._lost(exc, mid_frame=started) from None
        if count == 0:
            self._abort()
            if not started:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            raise PeerProtocolError(f"{self.peer} closed the connection mid-frame (truncated)")
        return count

    def _lost(self, exc: OSError, *, mid_frame: bool) -> NetTimeout | ConnectionClosed:
        """The error to raise for a socket failure. A timeout between frames leaves the
        connection usable; anything else (or a timeout mid-frame) closes it."""
        if isinstance(exc, TimeoutError):
            if self._deadline is not None:
                self._abort()
                return NetTimeout(f"handshake with {self.peer} did not finish in time")
            if mid_frame:  # the stream cannot be resynchronised
                self._abort()
            return NetTimeout(f"{self.peer} did not answer within the timeout")
        self._abort()
        return ConnectionClosed(f"connection to {self.peer} lost: {exc.strerror or exc}")

    def _fail(self, error: PeerProtocolError) -> PeerProtocolError:
        """The peer broke the protocol: tell it why (best effort) and close this connection.

        Logged at debug only: the error is raised, and whoever catches it (the server: one
        warning per session) reports it once."""
        log.debug("closing connection to %s: %s", self.peer, peer_text(error))
        self.send_error("protocol_error", str(error))
        self._abort()
        return error

    def recv_msg(self, expect: int | Collection[int], **kwargs: Any) -> dict[str, Any]:
        return self.recv(expect=expect, **kwargs).payload

    def recv_tokens(self, expect: int | Collection[int], **kwargs: Any) -> torch.Tensor:
        return self.recv(expect=expect, **kwargs).payload

    def recv_tensor(self, expect: int | Collection[int], **kwargs: Any) -> torch.Tensor:
        return self.recv(expect=expect, **kwargs).payload

    def recv_tensors(self, expect: int | Collection[int], **kwargs: Any) -> dict[str, torch.Tensor]:
        return self.recv(expect=expect, **kwargs).payload

    def request(
        self,
        msg_type: int,
        payload: Any = None,
        *,
        expect: int | Collection[int],
        timeout_s: float | None = _UNSET,
    ) -> Message:
        """Send a message with a fresh request id and wait for the reply carrying the same id."""
        request_id = self.next_request_id()
        self.send(msg_type, payload, request_id=request_id)
        reply = self.recv(expect=expect, timeout_s=timeout_s)
        if reply.request_id != request_id:
            raise self._fail(
                PeerProtocolError(
                    f"{self.peer} answered request {request_id} with id {reply.request_id}"
                )
            )
        return reply

    def ping(self, *, timeout_s: float | None = _UNSET) -> None:
        self.request(MsgType.PING, expect=MsgType.PONG, timeout_s=timeout_s)

    # ------------------------------------------------------------ teardown

    @property
    def closed(self) -> bool:
        return self._closed

    def interrupt(self) -> None:
        """From another thread: shut the socket down, so that whatever this connection's own
        thread is waiting on (a recv, the TLS or shared-secret handshake) ends at once."""
        with contextlib.suppress(OSError):
            # the plain socket's shutdown: SSLSocket's own drops its TLS state under the reader
            socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def _abort(self) -> None:
        self._closed = True
        self._spares = []  # up to two frame-cap-sized buffers: not kept by a closed connection
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Say goodbye (best effort) and close; safe to call twice."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self.send(MsgType.BYE)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._abort()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Connection({self.peer}{', closed' if self._closed else ''})"


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "unknown peer"
