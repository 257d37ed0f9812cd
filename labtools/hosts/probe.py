"""The emulated link itself: round trip and TCP rate between two hosts, per setting."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from labtools.hosts.network import Network

PROBE_PORT = 29590


def measure_link(network: Network, sender: str, receiver: str) -> dict[str, float]:
    """Round trip (ms) and the rate of one 4 MiB transfer (Mbit/s) from `sender` to `receiver`,
    measured with TCP between their namespaces (labtools.linkdelay probe)."""
    server = network[receiver].start(
        [sys.executable, "-m", "labtools.linkdelay", "probe-server", "--port", str(PROBE_PORT)],
        network.root / f"probe-{receiver}.log",
    )
    try:
        text = network[sender].run(
            [sys.executable, "-m", "labtools.linkdelay", "probe",
             "--to", f"{network[receiver].address}:{PROBE_PORT}"], timeout_s=120,
        )  # fmt: skip
        server.wait(timeout=30)
    finally:
        network[receiver].stop()
    return dict(json.loads(text.strip().splitlines()[-1]))


def link(delays_ms: Sequence[float], rates: Sequence[str | None], *, log: TextIO = sys.stdout
         ) -> list[dict[str, Any]]:  # fmt: skip
    """The emulated link itself, per (delay, rate): the round trip and transfer rate TCP sees
    between two hosts, next to what was asked for."""
    rows = []
    with Network(["desktop", "laptop"], delay_ms=delays_ms[0]) as network:
        print(f"{'delay ms':>8} {'rate':>8} {'rtt ms':>8} {'(2 x delay)':>11} "
              f"{'4 MiB Mbit/s':>12}", file=log, flush=True)  # fmt: skip
        for delay in delays_ms:
            for rate in rates:
                network.set_link(delay_ms=delay, rate=rate)
                got = measure_link(network, "laptop", "desktop")
                rows.append({"delay_ms": delay, "rate": rate or "none", **got})
                print(f"{delay:>8g} {rate or 'none':>8} {got['rtt_ms']:>8.2f} {2 * delay:>11g} "
                      f"{got['mbit_s']:>12.1f}", file=log, flush=True)  # fmt: skip
    return rows
