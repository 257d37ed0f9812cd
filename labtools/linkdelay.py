"""`python -m labtools.linkdelay forward --delay-ms D`: hold every packet D ms, then send it on.

The delaying path of labtools.hosts' routed network (netem is missing on the lab's machines, and
netproto's own link emulator does not carry TensorPipe's traffic): the switch namespace routes
every packet between hosts into a TUN device; this process reads each one, keeps it for D ms and
writes it back, and the switch routes it on to its host. A packet thus reaches its peer D ms
later than it would have, in order, whatever protocol carried it. One process, one thread: it
sleeps until a packet arrives or the oldest held one is due.

What it costs: two copies through user space per packet (a round trip at 0 ms delay takes
0.07-0.09 ms on the lab's 2-core machine, and one TCP stream peaks near 570-800 Mbit/s:
`python -m labtools.hosts link`), and CPU on the machine the hosts share.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536
BATCH = 256
"""Packets read per wake-up before the due ones are sent (bounds the delay's jitter)."""


def attach(dev: str) -> int:
    """A descriptor for the (already created) TUN device `dev` of this network namespace."""
    if not dev or len(dev.encode()) > 15:
        raise ValueError(f"a TUN device name has 1 to 15 bytes, got {dev!r}")
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return fd


def forward(fd: int, delay_s: float, *, stop: list[bool]) -> int:
    """Hold what `fd` gives for `delay_s` and write it back, until `stop[0]`; packets forwarded."""
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    forwarded = 0
    while not stop[0]:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            due = time.monotonic() + delay_s
            for _ in range(BATCH):
                try:
                    held.append((due, os.read(fd, MAX_PACKET)))
                except BlockingIOError:
                    break
        now = time.monotonic()
        while held and held[0][0] <= now:
            try:
                os.write(fd, held.popleft()[1])
            except OSError:  # a packet the stack refuses (its route gone): dropped, as a link would
                continue
            forwarded += 1
    return forwarded


PROBE_BYTES = 4 << 20
PROBE_ROUND_TRIPS = 20


def probe_server(port: int) -> None:
    """Answer one `probe` client: echo its one-byte pings, then acknowledge its bulk bytes."""
    with socket.create_server(("0.0.0.0", port), reuse_port=True) as server:
        server.settimeout(60)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(60)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(PROBE_ROUND_TRIPS):
            conn.recv(1)
            conn.sendall(b"y")
        got = 0
        while got < PROBE_BYTES:
            chunk = conn.recv(1 << 20)
            if not chunk:
                return
            got += len(chunk)
        conn.sendall(b"y")


def probe(address: str, port: int) -> dict[str, float]:
    """Round-trip time (median of 20 one-byte pings) and the rate of one 4 MiB transfer
    (slow start included, as a fresh connection sees it) to a `probe_server`."""
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=60)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(PROBE_ROUND_TRIPS):
            started = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            rtts.append(time.perf_counter() - started)
        started = time.perf_counter()
        conn.sendall(bytes(PROBE_BYTES))
        conn.recv(1)
        seconds = time.perf_counter() - started
    rtts.sort()
    return {"rtt_ms": rtts[len(rtts) // 2] * 1e3, "mbit_s": PROBE_BYTES * 8 / 1e6 / seconds}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labtools.linkdelay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fwd = sub.add_parser("forward", help="hold the TUN device's packets, then send them on")
    fwd.add_argument("--dev", default="tun0", help="the TUN device (made with ip tuntap)")
    fwd.add_argument("--delay-ms", type=float, required=True, help="one-way delay added")
    serve = sub.add_parser("probe-server", help="answer one probe")
    serve.add_argument("--port", type=int, required=True)
    measure = sub.add_parser("probe", help="round trip and transfer rate to a probe-server")
    measure.add_argument("--to", required=True, help="ADDRESS:PORT")
    args = parser.parse_args(argv)
    if args.command == "probe-server":
        probe_server(args.port)
        return 0
    if args.command == "probe":
        address, _, port = args.to.rpartition(":")
        print(json.dumps(probe(address, int(port))))
        return 0
    if not 0.0 <= args.delay_ms <= 10_000.0:
        parser.error(f"--delay-ms must be within 0..10000, got {args.delay_ms}")
    fd = attach(args.dev)
    stop = [False]

    def _stop(signum: int, frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"linkdelay: {args.dev} attached, holding packets {args.delay_ms:g} ms", flush=True)
    forwarded = forward(fd, args.delay_ms / 1000.0, stop=stop)
    print(f"linkdelay: stopped after {forwarded} packets", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
