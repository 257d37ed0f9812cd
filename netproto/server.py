"""A threaded netproto server: one thread and one session per connection.

A session is a plain function `handler(conn)` that loops on `conn.recv()`. Whatever goes wrong
in one session (a malformed frame, a failed handshake, a bug in the handler) closes that
connection only; the server and every other session keep going.

Strangers cannot crowd peers out. A session is unauthenticated until its handshake (TLS when
configured, then the shared secret when configured) is done, within `handshake_timeout_s` of
its connection in all. At most `max_unauthenticated` such sessions are open at once, and when a
newcomer finds no room an unauthenticated session is dropped for it (the oldest that has sent
nothing, else the oldest); a newcomer is refused only when every open session is
authenticated. With a secret or TLS the client speaks
first, so a connection gets its thread only once its first bytes arrive: an idle stranger
costs a file descriptor, not a thread. (Without a secret or TLS every session is authenticated
at once: see the README on what an open server accepts.)

One host cannot take every slot, secret or not: a remote address (an IPv6 /64) holds at most
`max_connections_per_address` sessions. Its newcomer over that share drops that address's own
oldest unauthenticated session, as above, or is closed at accept; nobody else pays for it.
Every frame, before and after the handshake, must arrive at a minimum rate (netproto's
`Limits.min_frame_bytes_per_s`): a peer dribbling bytes just within the read timeout is cut.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from netproto.connection import Connection
from netproto.errors import (
    AuthenticationError,
    ConnectionClosed,
    NetprotoError,
    NetTimeout,
    PeerProtocolError,
    peer_text,
)
from netproto.header import REGISTRY, Limits, Registry
from netproto.listener import Acceptor, StopSignal, listen

log = logging.getLogger(__name__)

Handler = Callable[[Connection], None]

CROWDING_LOG_INTERVAL_S = 10.0
"""Drops and refusals are summed up in one warning at most this often (a debug line each)."""


@dataclass(eq=False)
class _Session:
    sock: socket.socket
    accepted_at: float
    address: str
    """Its remote address as counted against `max_connections_per_address` (`address_key`)."""
    thread: threading.Thread | None = None
    """None while the connection waits, silent, in the accept loop's selector."""
    conn: Connection | None = None
    """Set once the socket is wrapped (TLS replaces the socket `sock` names)."""
    evicted: bool = False
    counted: bool = False
    """Whether it holds one of its address's slots (from admission until it ends or is
    dropped)."""

    def interrupt(self) -> None:
        """Make the session's thread stop waiting (on its handshake, or its peer)."""
        if self.conn is not None:
            self.conn.interrupt()
        else:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


class Server:
    """Listens on host:port (port 0: any free port; see `.address`) and runs `handler` per peer.

    Counters (read them, e.g. from a benchmark): `sessions_started` (connections admitted),
    `sessions_authenticated` (handshake done), `sessions_failed` (ended by an error, a handshake
    timeout included), `sessions_evicted` (unauthenticated, dropped to make room),
    `sessions_refused` (closed at once: no slot could be freed, or its address held its
    share: `sessions_capped` of them).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        ssl_context: ssl.SSLContext | None = None,
        limits: Limits = Limits(),
        read_timeout_s: float | None = 60.0,
        handshake_timeout_s: float = 10.0,
        max_connections: int = 256,
        max_unauthenticated: int = 64,
        max_connections_per_address: int = 64,
        registry: Registry = REGISTRY,
        name: str = "netproto",
        refusal_linger_s: float = 5.0,
    ) -> None:
        """`max_connections_per_address`: sessions one remote address may hold at once (64: a
        quarter of the default `max_connections`). `refusal_linger_s`: how long a session
        the handler refused (an authenticated peer breaking the protocol: it was sent an ERROR
        saying why) stays to read and drop what the peer still sends, so the peer reads the
        ERROR rather than a reset (`Connection.linger`); the session keeps its slot meanwhile."""
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections} must be >= 1")
        if max_connections_per_address < 1:
            raise ValueError(
                f"max_connections_per_address={max_connections_per_address} must be >= 1"
            )
        if max_unauthenticated < 1:
            raise ValueError(f"max_unauthenticated={max_unauthenticated} must be >= 1")
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s={handshake_timeout_s} must be > 0")
        self.handler = handler
        self.secret = secret
        self.ssl_context = ssl_context
        self.limits = limits
        self.read_timeout_s = read_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.max_connections_per_address = max_connections_per_address
        self.registry = registry
        self.name = name
        self.refusal_linger_s = refusal_linger_s
        self._bind = (host, port)
        self._listener: socket.socket | None = None
        self._stopping = StopSignal()
        """The accept loop blocks until a connection, a client speaking, a deadline (see
        `_next_wake`) or this: no polling."""
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._sessions: set[_Session] = set()
        """Admitted and not ended: waiting, in their handshake, or authenticated."""
        self._unauthenticated: OrderedDict[_Session, None] = OrderedDict()
        """Sessions before the end of their handshake, oldest first: the first to make way."""
        self._num_evicting = 0  # evicted sessions whose threads have not ended yet
        self._per_address: dict[str, int] = {}
        """Sessions counted against each address (only addresses that hold one)."""
        self._waiting: OrderedDict[_Session, None] = OrderedDict()  # the accept thread's own
        self.sessions_started = 0
        self.sessions_authenticated = 0
        self.sessions_failed = 0
        self.handshakes_failed = 0
        """Sessions whose peer failed the shared-secret handshake (a wrong or missing secret)."""
        self.sessions_evicted = 0
        self.sessions_refused = 0
        self.sessions_capped = 0
        self._reported = (0, 0, 0)  # (evicted, refused, capped) as of the last crowding warning
        self._reported_at = -float("inf")

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("server not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def active_sessions(self) -> int:
        """Connections admitted and not ended (dropped ones until their thread has ended)."""
        with self._lock:
            return len(self._sessions)

    @property
    def unauthenticated_sessions(self) -> int:
        with self._lock:
            return len(self._unauthenticated)

    def sessions_of(self, host: str) -> int:
        """Sessions the remote address `host` holds now (its share of the slots)."""
        with self._lock:
            return self._per_address.get(address_key(host), 0)

    def start(self) -> Server:
        self._listener = listen(*self._bind, name=self.name)
        self._accept_thread = threading.Thread(
            target=self._accept_loop, daemon=True, name=f"{self.name}-accept"
        )
        self._accept_thread.start()
        log.info(
            "%s listening on %s:%d%s%s",
            self.name,
            *self.address,
            " (auth)" if self.secret else "",
            " (TLS)" if self.ssl_context else "",
        )
        return self

    # ------------------------------------------------------------ the accept thread

    def _accept_loop(self) -> None:
        """Accept, admit, and start a session's thread once its client has spoken."""
        assert self._listener is not None
        acceptor = Acceptor(self._listener, self._stopping, name=self.name)
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._stopping.reader, selectors.EVENT_READ)
            try:
                while not self._stopping.is_set():
                    ready = selector.select(timeout=self._next_wake())
                    for key, _ in ready:  # clients that spoke start before newcomers come in
                        if isinstance(key.data, _Session) and key.data in self._waiting:
                            session = key.data
                            selector.unregister(session.sock)
                            del self._waiting[session]
                            self._run(session)
                    if any(key.fileobj is self._listener for key, _ in ready):
                        for sock in acceptor.accept_ready():
                            self._admit(sock, selector)
                    self._expire_waiting(selector)
                    self._report_crowding()
            finally:
                for session in list(self._waiting):
                    self._drop_waiting(session, selector)

    def _next_wake(self) -> float | None:
        """How long the accept loop may block with nothing ready: until the oldest silent
        connection's handshake deadline, or the next crowding report when one is due; else
        for good (a connection, a client speaking or `stop` wakes it)."""
        now, wake = time.monotonic(), None
        if self._waiting:
            wake = next(iter(self._waiting)).accepted_at + self.handshake_timeout_s - now
        with self._lock:
            counts = (self.sessions_evicted, self.sessions_refused, self.sessions_capped)
            if counts != self._reported:
                due = self._reported_at + CROWDING_LOG_INTERVAL_S - now
                wake = due if wake is None else min(wake, due)
        return None if wake is None else max(wake, 0.0)

    def _admit(self, sock: socket.socket, selector: selectors.BaseSelector) -> None:
        try:
            address = address_key(sock.getpeername()[0])
        except OSError:  # gone before we took it
            with contextlib.suppress(OSError):
                sock.close()
            return
        session = _Session(sock, time.monotonic(), address)
        with self._lock:
            evicted = self._make_room_at(address)
            capped = self._per_address.get(address, 0) >= self.max_connections_per_address
            if not capped:
                evicted += self._make_room()
            admitted = (
                not capped
                and len(self._sessions) - self._num_evicting < self.max_connections
                and self._num_evicting < self.max_connections  # threads still ending
            )
            if admitted:
                self._sessions.add(session)
                self._unauthenticated[session] = None
                self._per_address[address] = self._per_address.get(address, 0) + 1
                session.counted = True
                self.sessions_started += 1
            else:
                self.sessions_refused += 1
                self.sessions_capped += int(capped)
        for victim in evicted:
            if victim.thread is None:  # no thread: closing it is up to us
                self._drop_waiting(victim, selector)
            log.debug(
                "%s: dropped an unauthenticated session (%.1fs old) to make room",
                self.name,
                session.accepted_at - victim.accepted_at,
            )
        if not admitted:
            if capped:
                log.debug(
                    "%s: refused a connection from %s: it holds its %d sessions",
                    self.name,
                    address,
                    self.max_connections_per_address,
                )
            with contextlib.suppress(OSError):
                sock.close()
        elif self.secret or self.ssl_context:  # the client speaks first: wait for it
            selector.register(sock, selectors.EVENT_READ, session)
            self._waiting[session] = None
        else:
            self._run(session)

    def _make_room(self) -> list[_Session]:
        """Under the lock: drop unauthenticated sessions while a newcomer would exceed
        `max_connections` or `max_unauthenticated`; the sessions dropped.

        The oldest silent one goes first (it has sent nothing), else the oldest of those in
        their handshake: a crowd of idle connections cannot push out a client mid-handshake.
        """
        evicted: list[_Session] = []
        while self._unauthenticated and (
            len(self._sessions) - self._num_evicting >= self.max_connections
            or len(self._unauthenticated) >= self.max_unauthenticated
        ):
            victim = next(iter(self._waiting or self._unauthenticated))
            self._evict(victim)
            evicted.append(victim)
        return evicted

    def _make_room_at(self, address: str) -> list[_Session]:
        """Under the lock: while `address` holds its share of the slots, drop its own oldest
        unauthenticated session (silent first, as `_make_room`); the sessions dropped."""
        evicted: list[_Session] = []
        while self._per_address.get(address, 0) >= self.max_connections_per_address:
            victim = next((s for s in self._waiting if s.address == address), None) or next(
                (s for s in self._unauthenticated if s.address == address), None
            )
            if victim is None:  # all of them authenticated: the newcomer is refused
                break
            self._evict(victim)
            evicted.append(victim)
        return evicted

    def _evict(self, victim: _Session) -> None:
        """Under the lock: drop an unauthenticated session (its thread, if any, is stopped)."""
        del self._unauthenticated[victim]
        victim.evicted = True
        self._uncount(victim)
        if victim.thread is None:
            del self._waiting[victim]
            self._sessions.discard(victim)
        else:
            victim.interrupt()  # under the lock: its socket cannot be closed meanwhile
            self._num_evicting += 1
        self.sessions_evicted += 1

    def _uncount(self, session: _Session) -> None:
        """Under the lock: `session` no longer holds one of its address's slots."""
        if not session.counted:
            return
        session.counted = False
        left = self._per_address[session.address] - 1
        if left:
            self._per_address[session.address] = left
        else:
            del self._per_address[session.address]

    def _drop_waiting(self, session: _Session, selector: selectors.BaseSelector) -> None:
        """Close a session that never got a thread (dropped, timed out, or the server stops)."""
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(session.sock)
        self._waiting.pop(session, None)
        with self._lock:
            self._sessions.discard(session)
            self._unauthenticated.pop(session, None)
            self._uncount(session)
        with contextlib.suppress(OSError):
            session.sock.close()

    def _expire_waiting(self, selector: selectors.BaseSelector) -> None:
        """Close connections that stayed silent through the whole handshake deadline."""
        expired = time.monotonic() - self.handshake_timeout_s
        while self._waiting:
            session = next(iter(self._waiting))
            if session.accepted_at > expired:
                break
            peer = _peer_name(session.sock)
            self._drop_waiting(session, selector)
            log.warning(
                "%s: session with %s refused or timed out: sent nothing within %gs",
                self.name,
                peer,
                self.handshake_timeout_s,
            )
            self._count_failure()  # after its line: a reader of the count finds the line

    def _run(self, session: _Session) -> None:
        """Start the session's thread (or refuse it, when no thread can be started)."""
        thread = threading.Thread(
            target=self._session, args=(session,), daemon=True, name=f"{self.name}-session"
        )
        with self._lock:
            session.thread = thread
        try:
            thread.start()
        except RuntimeError:  # the process cannot start another thread: refuse this one
            with self._lock:
                self._sessions.discard(session)
                self._unauthenticated.pop(session, None)
                self._uncount(session)
                self.sessions_started -= 1
                self.sessions_refused += 1
            with contextlib.suppress(OSError):
                session.sock.close()

    def _report_crowding(self) -> None:
        """One warning per interval summing up drops and refusals, never one per connection."""
        now = time.monotonic()
        with self._lock:
            counts = (self.sessions_evicted, self.sessions_refused, self.sessions_capped)
            if counts == self._reported or now - self._reported_at < CROWDING_LOG_INTERVAL_S:
                return
            evicted, refused, capped = (
                new - old for new, old in zip(counts, self._reported, strict=True)
            )
            self._reported, self._reported_at = counts, now
        log.warning(
            "%s: crowded: %d unauthenticated sessions dropped to make room and %d connections "
            "refused (%d with no slot free of %d, %d from an address holding its %d) since the "
            "last report",
            self.name,
            evicted,
            refused,
            refused - capped,
            self.max_connections,
            capped,
            self.max_connections_per_address,
        )

    # ------------------------------------------------------------ a session's thread

    def _session(self, session: _Session) -> None:
        conn: Connection | None = None
        authenticated = False  # only an authenticated peer is lingered for after a refusal
        try:
            conn = Connection.accepted(
                session.sock,
                ssl_context=self.ssl_context,
                read_timeout_s=self.read_timeout_s,
                limits=self.limits,
                registry=self.registry,
            )
            with self._lock:
                session.conn = conn
            if not session.evicted:
                time_left = session.accepted_at + self.handshake_timeout_s - time.monotonic()
                conn.handshake_as_server(secret=self.secret, timeout_s=time_left)
            with self._lock:
                if not session.evicted:
                    del self._unauthenticated[session]
                    self.sessions_authenticated += 1
                    authenticated = True
            if not session.evicted:
                self.handler(conn)
        except ConnectionClosed:
            pass  # the peer left; a normal end of session
        except (NetprotoError, OSError) as exc:  # OSError: ssl.SSLError included
            if not session.evicted:  # (an eviction is reported by the accept loop)
                refused = isinstance(exc, AuthenticationError | NetTimeout | OSError)
                log.warning(  # one line, no traceback: the peer's doing, not a bug here
                    "%s: session with %s %s: %s",
                    self.name,
                    conn.peer if conn is not None else "a peer",
                    "refused or timed out" if refused else "closed",
                    peer_text(exc),
                )
                self._count_failure(handshake=isinstance(exc, AuthenticationError))
                if conn is not None and authenticated and isinstance(exc, PeerProtocolError):
                    conn.linger(self.refusal_linger_s)  # still counted: stop() interrupts it
        except Exception as exc:
            log.exception("%s: session handler failed", self.name)
            self._count_failure()
            if conn is not None:
                conn.send_error("internal", f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:  # unregister first: nobody interrupts a socket being closed
                self._sessions.discard(session)
                self._unauthenticated.pop(session, None)
                self._uncount(session)
                if session.evicted:
                    self._num_evicting -= 1
            if conn is not None:
                conn.close()
            else:
                with contextlib.suppress(OSError):
                    session.sock.close()

    def _count_failure(self, *, handshake: bool = False) -> None:
        """After the failure's log line: a reader of the counts finds the line."""
        with self._lock:
            self.sessions_failed += 1
            self.handshakes_failed += handshake

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every session's socket, and wait for their threads."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=timeout_s)  # it closes the waiting connections
        if self._listener is not None:
            self._listener.close()
        self._stopping.close()
        with self._lock:
            sessions = list(self._sessions)
            for session in sessions:
                session.interrupt()
        for session in sessions:
            if session.thread is not None:
                session.thread.join(timeout=timeout_s)

    def __enter__(self) -> Server:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def address_key(host: str) -> str:
    """What one remote host is counted as: its IPv4 address, or the /64 prefix of its IPv6
    one (a host is handed a whole /64: one address each would not bound it)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except (OSError, ValueError):
        return "a peer"
