"""Emulate a LAN or WAN link on one machine: a TCP proxy adding delay and a bandwidth cap.

    client --> [LinkEmulator listen port] --(delay, bandwidth)--> upstream server

Each direction is shaped on its own, like a real full-duplex link: a chunk that arrives at time
t leaves at max(t, when the link is free) + size / bandwidth (serialization), and is delivered
one-way `delay_ms` after it left. Queues are bounded, so a fast sender is slowed down by TCP
backpressure exactly as on a real bottleneck.

`LinkEmulatorProcess` runs the same proxy in a process of its own (`netproto.link.main`):
its threads then never wait for the GIL of a process that is busy computing, which would add
up to the interpreter's switch interval (5 ms) to a message's trip.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from netproto.listener import StopSignal, accept_until, listen

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
QUEUE_CHUNKS = 1024
"""Up to 64 MiB in flight per direction: enough for 1 Gbit/s x 500 ms of delay."""
STOP_WAIT_S = 2.0
"""How long `stop` waits for all its pump threads together (they see the sockets close)."""


class LinkEmulator:
    """A shaping proxy to `upstream`; connect to `.address` instead of the server."""

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        delay_ms: float = 0.0,
        bandwidth_mbps: float = 0.0,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        if delay_ms < 0 or bandwidth_mbps < 0:
            raise ValueError("delay_ms and bandwidth_mbps must be >= 0")
        self.upstream = upstream
        self.delay_s = delay_ms / 1000.0
        self.bytes_per_s = bandwidth_mbps * 1e6 / 8 if bandwidth_mbps else 0.0
        self._listen = (listen_host, listen_port)
        self._listener: socket.socket | None = None
        self._stopping = StopSignal()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("link emulator not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> LinkEmulator:
        self._listener = listen(*self._listen, backlog=64, name="link emulator")
        self._spawn(self._accept_loop, "link-accept")
        log.info(
            "link emulator %s:%d -> %s:%d (delay %.1f ms, %s)",
            *self.address,
            *self.upstream,
            self.delay_s * 1000,
            f"{self.bytes_per_s * 8 / 1e6:g} Mbit/s" if self.bytes_per_s else "no cap",
        )
        return self

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        accept_until(self._listener, self._stopping, self._connect_upstream)

    def _connect_upstream(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=10.0)
        except OSError as exc:
            log.warning("link emulator cannot reach %s:%d: %s", *self.upstream, exc)
            client.close()
            return
        server.settimeout(None)
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets += [client, server]
        self._start_direction(client, server, "up")
        self._start_direction(server, client, "down")

    def _start_direction(self, source: socket.socket, sink: socket.socket, name: str) -> None:
        chunks: queue.Queue[tuple[float, bytes] | None] = queue.Queue(maxsize=QUEUE_CHUNKS)
        self._spawn(self._read_side, f"link-{name}-read", source, sink, chunks)
        self._spawn(self._write_side, f"link-{name}-write", sink, chunks)

    def _read_side(
        self,
        source: socket.socket,
        sink: socket.socket,
        chunks: queue.Queue[tuple[float, bytes] | None],
    ) -> None:
        link_free_at = 0.0
        try:
            while True:
                data = source.recv(CHUNK_BYTES)
                if not data:
                    break
                now = time.monotonic()
                departs = max(now, link_free_at)
                if self.bytes_per_s:
                    departs += len(data) / self.bytes_per_s
                link_free_at = departs
                chunks.put((departs + self.delay_s, data))
        except OSError:
            pass
        finally:
            chunks.put(None)  # end of stream, delivered after the data before it

    def _write_side(
        self, sink: socket.socket, chunks: queue.Queue[tuple[float, bytes] | None]
    ) -> None:
        broken = False
        while (item := chunks.get()) is not None:
            if broken:
                continue  # keep draining so the reader never blocks on a full queue
            deliver_at, data = item
            wait = deliver_at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                sink.sendall(data)
            except OSError:
                broken = True
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_RDWR)
        if not broken:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        deadline = time.monotonic() + STOP_WAIT_S  # one wait for them all, not one each
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            log.warning(
                "link emulator: %d pump threads still running %.0f s after stop (%s)",
                len(stuck),
                STOP_WAIT_S,
                ", ".join(stuck[:4]),
            )
        self._stopping.close()

    def __enter__(self) -> LinkEmulator:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class LinkEmulatorProcess:
    """A LinkEmulator in its own process; the same arguments, `.address` and context manager.

    The child exits when this object stops it or when this process dies (its stdin closes).
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        delay_ms: float = 0.0,
        bandwidth_mbps: float = 0.0,
        listen_host: str = "127.0.0.1",
        start_timeout_s: float = 60.0,
    ) -> None:
        if delay_ms < 0 or bandwidth_mbps < 0:
            raise ValueError("delay_ms and bandwidth_mbps must be >= 0")
        self._args = [
            f"--upstream={upstream[0]}:{upstream[1]}",
            f"--delay-ms={delay_ms}",
            f"--bandwidth-mbps={bandwidth_mbps}",
            f"--listen-host={listen_host}",
        ]
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._address: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("link emulator not started")
        return self._address

    def start(self) -> LinkEmulatorProcess:
        self._proc = subprocess.Popen(
            # not `-m netproto.link`: the package imports this module before runpy runs it
            [sys.executable, "-c", "from netproto.link import main; main()", *self._args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        ready = threading.Event()
        line: list[str] = []

        def read_first_line() -> None:
            assert self._proc is not None and self._proc.stdout is not None
            line.append(self._proc.stdout.readline())
            ready.set()

        threading.Thread(target=read_first_line, daemon=True).start()
        if not ready.wait(self._start_timeout_s) or not line[0].startswith("listening "):
            self.stop()
            raise RuntimeError(f"the link emulator process did not start: {line[:1]!r}")
        _, host, port = line[0].split()
        self._address = (host, int(port))
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc, self._address = None, None

    def __enter__(self) -> LinkEmulatorProcess:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """`--upstream HOST:PORT [--delay-ms D] [--bandwidth-mbps B]`: the proxy as a program.

    Prints `listening HOST PORT` once it accepts, and runs until its stdin closes.
    """
    parser = argparse.ArgumentParser(description="a TCP proxy adding delay and a bandwidth cap")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0, help="0: no cap")
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--listen-port", type=int, default=0)
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--upstream {args.upstream!r} is not HOST:PORT")
    with LinkEmulator(
        (host, int(port)),
        delay_ms=args.delay_ms,
        bandwidth_mbps=args.bandwidth_mbps,
        listen_host=args.listen_host,
        listen_port=args.listen_port,
    ) as link:
        print("listening", *link.address, flush=True)
        sys.stdin.read()  # until the parent closes it, or dies
