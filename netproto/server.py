"""A threaded netproto server: one thread and one session per connection.

A session is a plain function `handler(conn)` that loops on `conn.recv()`. Whatever goes wrong
in one session (a malformed frame, a failed handshake, a bug in the handler) closes that
connection only; the server and every other session keep going.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any

from netproto.connection import Connection
from netproto.errors import AuthenticationError, ConnectionClosed, NetprotoError, NetTimeout
from netproto.listener import accept_until, listen
from netproto.wire import REGISTRY, Limits, Registry

log = logging.getLogger(__name__)

Handler = Callable[[Connection], None]


class Server:
    """Listens on host:port (port 0: any free port; see `.address`) and runs `handler` per peer."""

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
        registry: Registry = REGISTRY,
        name: str = "netproto",
    ) -> None:
        self.handler = handler
        self.secret = secret
        self.ssl_context = ssl_context
        self.limits = limits
        self.read_timeout_s = read_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.max_connections = max_connections
        self.registry = registry
        self.name = name
        self._bind = (host, port)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._sessions: dict[threading.Thread, socket.socket] = {}
        self.sessions_started = 0
        self.sessions_failed = 0

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("server not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

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

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_until(self._listener, self._stopping, self._start_session)

    def _start_session(self, sock: socket.socket) -> None:
        with self._lock:
            busy = len(self._sessions) >= self.max_connections
            if not busy:
                thread = threading.Thread(
                    target=self._session, args=(sock,), daemon=True, name=f"{self.name}-session"
                )
                self._sessions[thread] = sock
                self.sessions_started += 1
        if busy:
            log.warning(
                "%s: refusing a connection, %d sessions already open",
                self.name,
                self.max_connections,
            )
            sock.close()
            return
        thread.start()

    def _session(self, sock: socket.socket) -> None:
        conn: Connection | None = None
        try:
            conn = Connection.accept(
                sock,
                secret=self.secret,
                ssl_context=self.ssl_context,
                handshake_timeout_s=self.handshake_timeout_s,
                read_timeout_s=self.read_timeout_s,
                limits=self.limits,
                registry=self.registry,
            )
            self.handler(conn)
        except ConnectionClosed:
            pass  # the peer left; a normal end of session
        except (AuthenticationError, NetTimeout, ssl.SSLError, OSError) as exc:
            self._count_failure()
            log.warning("%s: session refused or timed out: %s", self.name, exc)
        except NetprotoError as exc:
            self._count_failure()
            log.warning("%s: session closed: %s", self.name, exc)
        except Exception as exc:
            self._count_failure()
            log.exception("%s: session handler failed", self.name)
            if conn is not None:
                conn.send_error("internal", f"{type(exc).__name__}: {exc}")
        finally:
            if conn is not None:
                conn.close()
            else:
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._sessions.pop(threading.current_thread(), None)

    def _count_failure(self) -> None:
        with self._lock:
            self.sessions_failed += 1

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop accepting, close every session's socket, and wait for their threads."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=timeout_s)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sessions = list(self._sessions.items())
        for _, sock in sessions:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread, _ in sessions:
            thread.join(timeout=timeout_s)

    def __enter__(self) -> Server:
        return self.start() if self._listener is None else self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
