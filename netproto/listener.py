"""The listening side shared by the server and the link emulator: bind, then accept until told
to stop. An accept loop blocks in its selector with no timeout and no polling; `StopSignal`
(an event its selector watches too) wakes it at once to stop."""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from netproto.errors import ListenError

log = logging.getLogger(__name__)

POLL_S = 0.1
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before accept (capped by net.core.somaxconn): a burst of
strangers must not fill it, or an honest client's SYN is dropped and retried a second later."""
ACCEPT_BATCH = 64
"""Connections taken per wake-up: a burst is drained without a select per connection."""
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept() errors that pass once connections close: wait a poll, then accept again."""
PEER_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
"""accept() errors about one connection only (it went away before we took it)."""
RESOURCE_LOG_INTERVAL_S = 10.0


class StopSignal(threading.Event):
    """A `threading.Event` an accept loop's selector can wait on beside its sockets: `set`
    also makes `reader` readable (for good), so the loop blocks without a timeout and still
    stops at once. `close` when the loop is done (two file descriptors)."""

    def __init__(self) -> None:
        super().__init__()
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)

    def set(self) -> None:
        super().set()
        with contextlib.suppress(OSError):  # closed, or a byte already waits
            self._writer.send(b"\0")

    def close(self) -> None:
        self.reader.close()
        self._writer.close()


def listen(
    host: str, port: int, *, backlog: int = LISTEN_BACKLOG, name: str = "netproto"
) -> socket.socket:
    """A non-blocking listening socket on host:port (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        hint = {
            errno.EADDRINUSE: ": another process holds that port (another run?); stop it, or "
            "choose a free port (0: any)",
            errno.EADDRNOTAVAIL: ": that address is not one of this host's",
        }.get(exc.errno or 0, "")
        error = ListenError(f"{name} cannot listen on {host}:{port}: {exc.strerror}{hint}")
        error.errno = exc.errno
        raise error from None
    listener.listen(backlog)
    listener.setblocking(False)
    return listener


class Acceptor:
    """Takes the connections a non-blocking listener has ready, riding out the errors that
    pass: running out of file descriptors (or memory) waits a poll and says so once in a
    while, a connection gone before it was taken is skipped."""

    def __init__(self, listener: socket.socket, stopping: threading.Event, *, name: str) -> None:
        self.listener = listener
        self.stopping = stopping
        self.name = name
        self._warned_at = -float("inf")

    def accept_ready(self) -> list[socket.socket]:
        """Up to ACCEPT_BATCH accepted (blocking) sockets; [] when none is ready."""
        accepted: list[socket.socket] = []
        while len(accepted) < ACCEPT_BATCH:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if self.stopping.is_set():
                    break
                if exc.errno in PEER_GONE:
                    continue
                if exc.errno not in OUT_OF_RESOURCES:
                    raise
                if time.monotonic() - self._warned_at >= RESOURCE_LOG_INTERVAL_S:
                    self._warned_at = time.monotonic()
                    log.warning("%s: cannot accept connections for now: %s", self.name, exc)
                self.stopping.wait(POLL_S)  # the pending connection stays readable: no spin
                break
            sock.setblocking(True)
            accepted.append(sock)
        return accepted


def accept_until(
    listener: socket.socket,
    stopping: StopSignal,
    on_accept: Callable[[socket.socket], None],
    *,
    name: str = "netproto",
) -> None:
    """Hand every accepted (blocking) socket to `on_accept` until `stopping` is set."""
    acceptor = Acceptor(listener, stopping, name=name)
    with selectors.DefaultSelector() as selector:
        try:
            selector.register(listener, selectors.EVENT_READ)
            selector.register(stopping.reader, selectors.EVENT_READ)
        except (ValueError, OSError):
            if stopping.is_set():  # stopped (its listener closed) before this thread began
                return
            raise
        while not stopping.is_set():
            selector.select()
            if not stopping.is_set():
                for sock in acceptor.accept_ready():
                    on_accept(sock)
