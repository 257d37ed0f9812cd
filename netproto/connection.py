"""A blocking netproto connection: typed send/recv over one TCP (optionally TLS) socket.

Large payloads go out with one scatter-gather `sendmsg` of header + memoryviews of the tensor
storage (no join, no copy) and come in with `recv_into` a buffer allocated only after the
header's length has passed the frame cap. Tensors received are views into that buffer.

Waiting has two bounds. Between frames, the read timeout: how long a peer may stay silent.
Within a frame, a deadline that each byte moves on (`Limits.min_frame_bytes_per_s`, after
`Limits.frame_grace_s`): a peer sending a byte just before each read would time out holds the
connection for the grace and no longer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from netproto import auth
from netproto.codecs import Buffer, EncodedFrame, encode_frame, new_payload_buffer
from netproto.errors import (
    ConnectionClosed,
    LocalProtocolError,
    NetprotoError,
    NetTimeout,
    PeerProtocolError,
    RemoteError,
    TruncatedFrame,
    peer_text,
)
from netproto.header import (
    AUTH_LIMITS,
    REGISTRY,
    Limits,
    Message,
    MessageSpec,
    MsgType,
    PayloadKind,
    Registry,
)
from netproto.wire import FrameDecoder

log = logging.getLogger(__name__)

IOV_MAX = 1024
SMALL_SEND_BYTES = 64 * 1024
"""Frames up to this size are joined and sent with one sendall."""
REUSE_MIN_BYTES = 1 << 20
"""Payloads this big are received into a buffer reused across frames once nothing uses it."""
NUM_SPARE_BUFFERS = 2
MIN_WAIT_S = 1e-3
"""The shortest wait a receive is given, past a deadline included: bytes already in the
kernel's buffer are taken (our own stall is not the peer's fault), and only then is it late."""


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
_CONTROL = frozenset({MsgType.ERROR, MsgType.PING, MsgType.PONG, MsgType.BYE} | _AUTH_TYPES)
"""netproto's own messages, which `recv` handles itself unless the caller expects them."""
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
        self._registry = registry
        self._specs = registry.specs
        self._read_timeout_s = read_timeout_s
        self._send_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._closed = False
        self._in_handshake = False
        self._deadline: float | None = None  # monotonic; set while the handshake runs
        self._frame_started: float | None = None  # monotonic; when a frame's first byte came
        self._bound = "read"  # which bound the socket's timeout is: read, frame or handshake
        self._timeout = read_timeout_s  # the socket's timeout as last set
        self.peer = peer or _peer_name(sock)
        self.peer_host = _peer_host(sock)
        """The remote address (no port), e.g. to count one host's connections."""
        self.bytes_sent = 0
        self.last_sent = time.monotonic()
        """When the last whole frame went out: a heartbeat is due only after silence."""
        self.last_received = time.monotonic()
        """When the last whole frame arrived (heartbeats included): for liveness checks."""
        self._spares: list[torch.Tensor] = []  # big receive buffers, reused when unshared
        self._reader = FrameDecoder(limits=limits, registry=registry, allocate=self._payload_buffer)
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
        source_address: tuple[str, int] | None = None,
    ) -> Connection:
        """Connect (TLS when `ssl_context`), authenticate when `secret`, return the connection.

        `connect_timeout_s` bounds all of it together: TCP connect, TLS and the handshake.
        `source_address`: the local (host, port) to connect from (a host with several).
        """
        deadline = time.monotonic() + connect_timeout_s
        try:
            sock = socket.create_connection(
                (host, port), timeout=connect_timeout_s, source_address=source_address
            )
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
                try:
                    sock = ssl_context.wrap_socket(
                        sock, server_hostname=server_hostname or host, do_handshake_on_connect=False
                    )
                except OSError as exc:  # reset between connect and TLS: a server going down
                    raise ConnectionClosed(
                        f"{host}:{port} closed the connection before TLS: {exc.strerror or exc}"
                    ) from None
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
                self._reader.limits = AUTH_LIMITS  # nothing bigger than a handshake frame
                if server_side:
                    auth.server_handshake(self, secret)
                else:
                    auth.client_handshake(self, secret)
                self._reader.limits = self._limits
        finally:
            self._in_handshake = False
            self._deadline = None
        self._set_timeout(self._read_timeout_s)

    def _set_timeout(self, timeout_s: float | None) -> None:
        """The socket's timeout for its next calls (a system call only when it changes)."""
        if timeout_s != self._timeout:
            self._sock.settimeout(timeout_s)
            self._timeout = timeout_s

    def _arm_deadline(self) -> None:
        """During the handshake: the next socket call may wait only for the time left."""
        assert self._deadline is not None
        left = self._deadline - time.monotonic()
        if left <= 0:
            self._abort()
            raise NetTimeout(f"handshake with {self.peer} did not finish in time")
        self._set_timeout(left)

    def _arm_receive(self, read_timeout_s: float | None) -> None:
        """Before a receive: wait at most the read timeout, cut to what is left of the
        frame's deadline once a frame has begun, and of the handshake's while it runs.
        Remembers which bound it set (`_lost` names it)."""
        timeout, self._bound = read_timeout_s, "read"
        if self._frame_started is not None:
            allowed = self._limits.frame_allowance_s(self._reader.frame_progress)
            if math.isfinite(allowed):
                left = max(self._frame_started + allowed - time.monotonic(), MIN_WAIT_S)
                if timeout is None or left < timeout:
                    timeout, self._bound = left, "frame"
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self._abort()
                raise NetTimeout(f"handshake with {self.peer} did not finish in time")
            if timeout is None or left < timeout:
                timeout, self._bound = left, "handshake"
        self._set_timeout(timeout)

    # ------------------------------------------------------------ sending

    def send(
        self, msg_type: int, payload: Any = None, *, request_id: int = 0, flags: int = 0
    ) -> int:
        """Send one message; the payload's encoding follows the type's registered kind.

        Returns the frame's size in bytes. LocalProtocolError (nothing sent) when the payload
        does not fit the type or the limits. A small frame goes out in one write.
        """
        spec = self._specs.get(msg_type)
        if spec is None:
            raise LocalProtocolError(f"message type {msg_type:#06x} is not registered")
        return self._send(spec, payload, request_id, flags)

    def encode(
        self, msg_type: int, payload: Any = None, *, request_id: int = 0, flags: int = 0
    ) -> EncodedFrame:
        """The frame `send` would send, encoded once against this connection's registry and
        limits, for `send_encoded` here and on every connection with the same ones (a
        broadcast). LocalProtocolError as `send` raises it."""
        spec = self._specs.get(msg_type)
        if spec is None:
            raise LocalProtocolError(f"message type {msg_type:#06x} is not registered")
        return EncodedFrame.of(
            spec, payload, limits=self._limits, request_id=request_id, flags=flags
        )

    def send_encoded(self, frame: EncodedFrame) -> int:
        """Send a frame `encode` made, as it is: the bytes `send` would send, not encoded
        again. LocalProtocolError (nothing sent) when it was checked against another registry
        or other limits than this connection's. Returns its size in bytes."""
        if self._specs.get(frame.spec.type) != frame.spec or frame.limits != self._limits:
            raise LocalProtocolError(
                f"a {frame.spec.name} frame encoded for another registry or other limits "
                f"cannot go to {self.peer}"
            )
        return self._write((frame.data,), frame.size)

    def _send(self, spec: MessageSpec, payload: Any, request_id: int, flags: int) -> int:
        buffers, size = encode_frame(spec, payload, request_id, flags, self._limits)
        return self._write(buffers, size)

    def _write(self, buffers: Sequence[Buffer], size: int) -> int:
        """One frame's buffers, in one write when small, under the send lock."""
        with self._send_lock:
            if self._closed:
                raise ConnectionClosed(f"connection to {self.peer} is closed")
            if self._deadline is not None:
                self._arm_deadline()
            try:
                if size <= SMALL_SEND_BYTES:
                    self._sock.sendall(b"".join(buffers))
                else:
                    self._sendall(buffers)
            except OSError as exc:  # a half-sent frame cannot be taken back: close
                raise self._lost(exc, mid_frame=True) from None
            self.bytes_sent += size
            self.last_sent = time.monotonic()
        return size

    def _sendall(self, buffers: Sequence[Buffer]) -> None:
        """A big frame: one scatter-gather write of views of its buffers (no join, no copy)."""
        views = [memoryview(b).cast("B") for b in buffers if memoryview(b).nbytes]
        if isinstance(self._sock, ssl.SSLSocket):  # no sendmsg over TLS
            for view in views:
                self._sock.sendall(view)
            return
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

    def _send_kind(
        self, msg_type: int, kind: PayloadKind, method: str, payload: Any, request_id: int
    ) -> int:
        spec = self._specs.get(msg_type)
        if spec is None:
            raise LocalProtocolError(f"message type {msg_type:#06x} is not registered")
        if spec.kind is not kind:
            raise LocalProtocolError(
                f"{method} cannot send {spec.name}, which carries {spec.kind.name}"
            )
        return self._send(spec, payload, request_id, 0)

    def send_msg(
        self, msg_type: int, body: Mapping[str, Any] | None = None, *, request_id: int = 0
    ) -> int:
        """A small control message (a JSON object)."""
        return self._send_kind(msg_type, PayloadKind.JSON, "send_msg", dict(body or {}), request_id)

    def send_tokens(
        self, msg_type: int, tokens: Sequence[int] | torch.Tensor, *, request_id: int = 0
    ) -> int:
        return self._send_kind(msg_type, PayloadKind.TOKENS, "send_tokens", tokens, request_id)

    def send_tensor(self, msg_type: int, tensor: torch.Tensor, *, request_id: int = 0) -> int:
        return self._send_kind(msg_type, PayloadKind.TENSOR, "send_tensor", tensor, request_id)

    def send_tensors(
        self, msg_type: int, tensors: Mapping[str, torch.Tensor], *, request_id: int = 0
    ) -> int:
        return self._send_kind(msg_type, PayloadKind.TENSORS, "send_tensors", tensors, request_id)

    def send_error(
        self, code: str, message: str, *, request_id: int = 0, retry_after_s: float | None = None
    ) -> None:
        """Tell the peer why we refuse or fail (`retry_after_s`: when to ask again); best
        effort (the peer may be gone)."""
        body: dict[str, Any] = {"code": code, "message": message[:2000]}
        if retry_after_s is not None:
            body["retry_after_s"] = retry_after_s
        with contextlib.suppress(Exception):
            self.send(MsgType.ERROR, body, request_id=request_id)

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
        expected: Collection[int] | None
        if expect is None or isinstance(expect, int):
            expected = None if expect is None else (expect,)
        else:
            expected = expect
        read_timeout_s = self._read_timeout_s if timeout_s is _UNSET else timeout_s
        try:
            while True:
                message = self._recv_frame(read_timeout_s)
                if expected is not None and message.type in expected:
                    return message
                if expected is None and message.type not in _CONTROL and not self._in_handshake:
                    return message  # an application message, the commonest case
                if message.type == MsgType.ERROR:
                    body = message.payload
                    raise RemoteError(
                        str(body.get("code", "error")),
                        str(body.get("message", "")),
                        retry_after_s=body.get("retry_after_s"),
                    )
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
        finally:  # sends wait for the read timeout too (a heartbeat may send meanwhile)
            if self._timeout != self._read_timeout_s and not self._closed and not self._deadline:
                with contextlib.suppress(OSError):
                    self._set_timeout(self._read_timeout_s)

    def _expected_names(self, expected: Collection[int]) -> str:
        return " or ".join(sorted(self._registry.name(t) for t in expected))

    def readable(self, timeout_s: float = 0.0) -> bool:
        """Whether a message has begun to arrive (or the peer closed), waiting up to `timeout_s`.

        Lets one thread interleave work with receiving: `recv` after True does not wait for
        the peer to decide to send, only for the rest of a frame already on its way.
        """
        if self._closed:
            return True  # recv says why
        if self._reader.buffered:
            return True
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return True
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        return bool(ready)

    def _recv_frame(self, read_timeout_s: float | None) -> Message:
        """The next frame from the reader, receiving straight into where it wants the bytes:
        one recv_into for a frame that fits the read buffer (header and payload together).
        The frame's deadline runs from when its first byte is seen."""
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed")
        reader = self._reader
        recv_into = self._sock.recv_into
        try:
            message = reader.next_message()
            while message is None:
                if self._frame_started is None and reader.mid_frame:
                    self._frame_started = time.monotonic()
                if reader.in_payload:
                    self._receive_payload(reader, read_timeout_s)
                else:
                    if (
                        self._frame_started is not None
                        or self._deadline is not None
                        or self._timeout != read_timeout_s
                    ):  # (else the socket waits for the read timeout already)
                        self._arm_receive(read_timeout_s)
                    try:
                        count = recv_into(reader.writable())
                    except OSError as exc:
                        raise self._lost(exc, mid_frame=reader.mid_frame, receiving=True) from None
                    if not count:
                        raise self._ended(reader, mid_frame=reader.mid_frame)
                    reader.wrote(count)
                message = reader.next_message()
        except PeerProtocolError as exc:
            if self._closed:  # the stream ended mid-frame: already closed
                raise
            raise self._fail(exc) from None
        self._frame_started, self._bound = None, "read"
        self.last_received = time.monotonic()
        return message

    def _receive_payload(self, reader: FrameDecoder, read_timeout_s: float | None) -> None:
        """A big payload: a tight loop of recv_into straight into its own buffer until whole."""
        view = reader.writable()
        got, size, recv_into = 0, view.nbytes, self._sock.recv_into
        try:
            while got < size:
                self._arm_receive(read_timeout_s)
                count = recv_into(view[got:])
                if not count:
                    break
                got += count
                reader.wrote(count)  # (moves the frame's deadline on)
        except OSError as exc:
            raise self._lost(exc, mid_frame=True, receiving=True) from None
        if got < size:
            raise self._ended(reader, mid_frame=True)

    def _ended(self, reader: FrameDecoder, *, mid_frame: bool) -> NetprotoError:
        """The peer closed its side: between frames a close, within one a truncation."""
        self._abort()
        if not mid_frame:
            return ConnectionClosed(f"{self.peer} closed the connection")
        return reader.fail(
            TruncatedFrame(f"{self.peer} closed the connection mid-frame (truncated)")
        )

    @property
    def bytes_received(self) -> int:
        """Bytes of the whole frames received (headers included)."""
        return self._reader.frame_bytes

    def _payload_buffer(self, length: int) -> torch.Tensor:
        """A buffer for a big payload: a spare nobody views any more and at most twice its
        size (a small tensor held from a big spare would keep the whole spare alive: a peer's
        one huge frame, then its small one, pinning the huge buffer for as long as the small
        one is kept), else a new one.

        Two spares, because the natural loop `message = conn.recv()` still holds the previous
        message while the next one arrives. Fresh big buffers cost page faults on every frame
        (about as long as the loopback transfer itself at 64 MiB).
        """
        for spare in self._spares:
            if (
                length <= spare.numel() <= 2 * length
                and _UNSHARED_REFS is not None
                and _storage_refs(spare) == _UNSHARED_REFS
            ):
                return spare[:length]
        buffer = new_payload_buffer(length)
        if length >= REUSE_MIN_BYTES:
            self._spares = [buffer, *self._spares][:NUM_SPARE_BUFFERS]
        return buffer

    def _lost(
        self, exc: OSError, *, mid_frame: bool, receiving: bool = False
    ) -> NetTimeout | ConnectionClosed:
        """The error to raise for a socket failure. A timeout between frames leaves the
        connection usable; anything else (or a timeout mid-frame) closes it."""
        if isinstance(exc, TimeoutError):
            if self._deadline is not None:
                self._abort()
                return NetTimeout(f"handshake with {self.peer} did not finish in time")
            if receiving and self._bound == "frame":
                return self._too_slow()
            if mid_frame:  # the stream cannot be resynchronised
                self._abort()
            return NetTimeout(f"{self.peer} did not answer within the timeout")
        self._abort()
        return ConnectionClosed(f"connection to {self.peer} lost: {exc.strerror or exc}")

    def _too_slow(self) -> NetTimeout:
        """The frame's deadline passed: the peer sends slower than the minimum rate. Closed."""
        assert self._frame_started is not None
        received = self._reader.frame_progress
        elapsed = time.monotonic() - self._frame_started
        self._abort()
        limits = self._limits
        return NetTimeout(
            f"{self.peer} sent {received} bytes of a frame in {elapsed:.1f}s: slower than "
            f"{limits.min_frame_bytes_per_s * 8 / 1000:g} kbit/s after a grace of "
            f"{limits.frame_grace_s:g}s (the frame deadline: cluster.min_frame_rate_kbps)"
        )

    def _fail(self, error: PeerProtocolError) -> PeerProtocolError:
        """The peer broke the protocol: tell it why (best effort) and close this connection.

        Logged at debug only: the error is raised, and whoever catches it (the server: one
        warning per session) reports it once."""
        log.debug("closing connection to %s: %s", self.peer, peer_text(error))
        self.send_error("protocol_error", str(error))
        self._abort()
        return error

    def recv_msg(
        self, expect: int | Collection[int], *, timeout_s: float | None = _UNSET
    ) -> dict[str, Any]:
        return self.recv(expect=expect, timeout_s=timeout_s).payload

    def recv_tokens(
        self, expect: int | Collection[int], *, timeout_s: float | None = _UNSET
    ) -> torch.Tensor:
        return self.recv(expect=expect, timeout_s=timeout_s).payload

    def recv_tensor(
        self, expect: int | Collection[int], *, timeout_s: float | None = _UNSET
    ) -> torch.Tensor:
        return self.recv(expect=expect, timeout_s=timeout_s).payload

    def recv_tensors(
        self, expect: int | Collection[int], *, timeout_s: float | None = _UNSET
    ) -> dict[str, torch.Tensor]:
        return self.recv(expect=expect, timeout_s=timeout_s).payload

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
        self._reader.release()
        with contextlib.suppress(OSError):
            self._sock.close()

    def linger(self, seconds: float, *, max_bytes: int = 1 << 20) -> None:
        """After a refusal: say goodbye, stop sending, and read (and drop) what the peer still
        sends until it closes, `seconds` pass or `max_bytes` arrive; then close. A peer that
        kept sending after its refused frame (a drafter's drafts follow its OPEN unanswered)
        reads the ERROR we sent, not a reset: closing with its bytes unread here would answer
        them with a TCP reset, and the peer's next send would fail before it read why."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self.send(MsgType.BYE)
        deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self._sock, socket.SHUT_WR)  # our FIN after the ERROR
            while max_bytes > 0 and (left := deadline - time.monotonic()) > 0:
                self._sock.settimeout(left)
                # the raw bytes, TLS records included: dropped, never decoded
                dropped = socket.socket.recv(self._sock, min(max_bytes, 1 << 16))
                if not dropped:
                    break  # the peer has closed: nothing left to reset
                max_bytes -= len(dropped)
        self._abort()

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


def _peer_host(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername()[0])
    except (OSError, IndexError):
        return ""
