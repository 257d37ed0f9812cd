"""The listening side shared by the server and the link emulator: bind, then accept until told
to stop (polled, so `stop()` never waits on a blocked accept)."""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable

POLL_S = 0.1


def listen(host: str, port: int, *, backlog: int = 128, name: str = "netproto") -> socket.socket:
    """A non-blocking listening socket on host:port (port 0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise OSError(
            exc.errno, f"{name}: cannot listen on {host}:{port}: {exc.strerror}"
        ) from None
    listener.listen(backlog)
    listener.setblocking(False)
    return listener


def accept_until(
    listener: socket.socket, stopping: threading.Event, on_accept: Callable[[socket.socket], None]
) -> None:
    """Hand every accepted (blocking) socket to `on_accept` until `stopping` is set."""
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        while not stopping.is_set():
            if not selector.select(timeout=POLL_S):
                continue
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                if stopping.is_set():
                    return
                raise
            sock.setblocking(True)
            on_accept(sock)
