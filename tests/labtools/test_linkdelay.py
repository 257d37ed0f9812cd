"""The delaying forwarder (labtools.linkdelay) on a datagram socket pair standing in for its TUN
device (one read, one packet, as TUN gives them): every packet comes back in order and never
before its delay, and its stats count what it did."""

from __future__ import annotations

import os
import socket
import threading
import time

from labtools.linkdelay import LATE_BOUNDS_MS, ForwardStats, forward

DELAY_S = 0.02


def test_every_packet_comes_back_in_order_and_never_before_its_delay() -> None:
    ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    its.setblocking(False)
    stop, stats, forwarded = [False], ForwardStats(), []
    thread = threading.Thread(
        target=lambda: forwarded.append(forward(its.fileno(), DELAY_S, stop=stop, stats=stats))
    )
    thread.start()
    sent: dict[int, float] = {}
    received: list[tuple[int, float]] = []
    try:
        ours.settimeout(30)
        for burst in range(5):  # bursts the forwarder reads at once, and gaps between them
            for k in range(8):
                number = burst * 8 + k
                sent[number] = time.monotonic()
                ours.send(number.to_bytes(4, "big") + os.urandom(60 + number))
            time.sleep(DELAY_S / 3)
        while len(received) < len(sent):
            packet = ours.recv(2048)
            received.append((int.from_bytes(packet[:4], "big"), time.monotonic()))
            assert len(packet) == 4 + 60 + received[-1][0]  # whole, as it was sent
    finally:
        stop[0] = True
        thread.join(timeout=30)
        ours.close()
        its.close()
    assert [n for n, _ in received] == list(range(40))  # the order kept
    assert all(at - sent[n] >= DELAY_S for n, at in received)  # a floor: held, not a timing
    assert forwarded == [40] and stats.packets == 40
    assert stats.min_hold_ms >= DELAY_S * 1e3
    assert sum(stats.late_counts) == 40


def test_a_flood_past_the_hold_is_dropped_and_counted_and_the_rest_kept_in_order() -> None:
    """More packets than the hold takes arrive at once: the first `max_held` come back, in
    order, the rest are read and dropped (counted), as a full queue on a link drops them."""
    ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    its.setblocking(False)
    for number in range(30):  # all queued before the forwarder's first read
        ours.send(number.to_bytes(4, "big"))
    stop, stats, forwarded = [False], ForwardStats(), []
    thread = threading.Thread(
        target=lambda: forwarded.append(
            forward(its.fileno(), DELAY_S, stop=stop, stats=stats, max_held=10)
        )
    )
    thread.start()
    received: list[int] = []
    try:
        ours.settimeout(30)
        while len(received) < 10:
            received.append(int.from_bytes(ours.recv(64)[:4], "big"))
    finally:
        stop[0] = True
        thread.join(timeout=30)
        ours.close()
        its.close()
    assert received == list(range(10))
    assert forwarded == [10] and stats.dropped == 20 and stats.summary()["dropped"] == 20


def test_the_stats_put_each_packet_in_its_lateness_bucket() -> None:
    stats = ForwardStats()
    stats.count(0.005, 0.00003)  # 0.03 ms late: under the first bound
    stats.count(0.005, 0.0003)  # 0.3 ms
    stats.count(0.007, 0.009)  # 9 ms: over the last bound
    stats.count(0.005, -0.00001)  # a clock read a hair early counts as on time
    summary = stats.summary()
    counts = summary["late_counts"]
    assert isinstance(counts, list) and len(counts) == len(LATE_BOUNDS_MS) + 1
    assert counts[0] == 2 and counts[LATE_BOUNDS_MS.index(0.5)] == 1 and counts[-1] == 1
    assert summary["packets"] == 4 and summary["late_max_ms"] == 9.0
    assert summary["min_hold_ms"] == 5.0
