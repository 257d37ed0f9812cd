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
import bisect
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536
BATCH = 256
MAX_HELD = 10_000
"""Packets the forwarder holds at most (a veth's default txqueuelen is 1,000; 10x that)."""
MAX_HELD_BYTES = 64 << 20
"""Bytes it holds at most: past either bound a packet is dropped and counted."""
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


LATE_BOUNDS_MS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Upper bounds (ms) of the lateness buckets `ForwardStats` counts packets in; one more bucket
holds the rest."""


@dataclass
class ForwardStats:
    """What the forwarder did: packets sent on, and how late each went out after its due time
    (read time + the delay). Lateness is the forwarder's own: its wake-up after the hold, and
    packets queued behind others; the time a packet waited in the TUN device before the read is
    not seen here."""

    packets: int = 0
    late_counts: list[int] = field(default_factory=lambda: [0] * (len(LATE_BOUNDS_MS) + 1))
    """Packets per lateness bucket: under LATE_BOUNDS_MS[0] ms, ..., over the last bound."""
    late_max_ms: float = 0.0
    late_sum_ms: float = 0.0
    min_hold_ms: float = float("inf")
    """The shortest time a packet was held, read to write (never under the delay)."""
    dropped: int = 0
    """Packets read while the hold was full (MAX_HELD packets or MAX_HELD_BYTES): dropped, as
    a full queue on a real link drops them."""

    def count(self, hold_s: float, late_s: float) -> None:
        late_ms = max(0.0, late_s * 1e3)
        self.packets += 1
        self.late_counts[bisect.bisect_left(LATE_BOUNDS_MS, late_ms)] += 1
        self.late_max_ms = max(self.late_max_ms, late_ms)
        self.late_sum_ms += late_ms
        self.min_hold_ms = min(self.min_hold_ms, hold_s * 1e3)

    def summary(self) -> dict[str, float | int | list[int] | list[float]]:
        """As one JSON-able record: packets, mean and max lateness (ms), buckets, shortest hold."""
        return {
            "packets": self.packets,
            "late_mean_ms": self.late_sum_ms / self.packets if self.packets else 0.0,
            "late_max_ms": self.late_max_ms,
            "late_bounds_ms": list(LATE_BOUNDS_MS),
            "late_counts": self.late_counts,
            "min_hold_ms": self.min_hold_ms if self.packets else 0.0,
            "dropped": self.dropped,
        }


def forward(
    fd: int,
    delay_s: float,
    *,
    stop: list[bool],
    clock: Callable[[], float] = time.monotonic,
    stats: ForwardStats | None = None,
    max_held: int = MAX_HELD,
    max_held_bytes: int = MAX_HELD_BYTES,
) -> int:
    """Hold what `fd` gives for `delay_s` and write it back, in order, until `stop[0]`; packets
    forwarded. `stats`, when given, counts each packet's hold and lateness. What arrives while
    `max_held` packets or `max_held_bytes` are held is read and dropped (a flood costs a
    bounded queue, and the forwarder never spins on a device it stopped reading)."""
    held: collections.deque[tuple[float, bytes]] = collections.deque()
    held_bytes = 0
    forwarded = 0
    while not stop[0]:
        timeout = max(0.0, held[0][0] - clock()) if held else 0.5
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            due = clock() + delay_s
            for _ in range(BATCH):
                try:
                    packet = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                if len(held) >= max_held or held_bytes + len(packet) > max_held_bytes:
                    if stats is not None:
                        stats.dropped += 1
                    continue
                held.append((due, packet))
                held_bytes += len(packet)
        now = clock()
        while held and held[0][0] <= now:
            packet_due, packet = held.popleft()
            held_bytes -= len(packet)
            try:
                os.write(fd, packet)
            except OSError:  # a packet the stack refuses (its route gone): dropped, as a link would
                continue
            forwarded += 1
            if stats is not None:
                sent = clock()
                stats.count(sent - (packet_due - delay_s), sent - packet_due)
    return forwarded


REALTIME_PRIORITY = 10
"""SCHED_FIFO priority of `forward --realtime`: above every ordinary process, so a packet due
goes out when due, whatever the hosts compute; below threaded interrupt handlers (50), though
above the kernel's ordinary-priority threads (ksoftirqd, kworkers) on its core. A flood from a
namespace host costs it at most the kernel's real-time throttle (sched_rt_runtime_us, 95% of a
core by default) and a bounded hold (MAX_HELD, MAX_HELD_BYTES): the harness's own processes are
its only senders."""
STATS_PREFIX = "linkdelay stats: "
"""How the forwarder's last line, its `ForwardStats.summary()` as JSON, begins."""
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
    fwd.add_argument(
        "--realtime",
        action="store_true",
        help="run at real-time priority (SCHED_FIFO, root): the wire ahead of the hosts' work",
    )
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
    if args.realtime:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    stop = [False]

    def _stop(signum: int, frame: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    said = " at real-time priority" if args.realtime else ""
    print(f"linkdelay: {args.dev} attached, holding packets {args.delay_ms:g} ms{said}", flush=True)
    stats = ForwardStats()
    forwarded = forward(fd, args.delay_ms / 1000.0, stop=stop, stats=stats)
    print(f"linkdelay: stopped after {forwarded} packets", file=sys.stderr)
    print(f"{STATS_PREFIX}{json.dumps(stats.summary())}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
