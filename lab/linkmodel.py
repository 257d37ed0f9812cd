"""Latency is compute time plus transmission time: a link of D ms one way and B bit/s, as the
cost model sees it, and what a run folder tells it.

A local run (every role on one machine's loopback) measures the compute; each experiment's
manifest says how its headline figure grows on a link (`Headline.predict`), with this module's
`Link`: its one-way delay once for every message a step waits for in turn, each transfer's bytes
over its rate, and TCP's slow start after an idle spell (`Link.slow_start_s`). `labtools.costmodel`
runs the predictions and judges them against the harness's measured curves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lab.records import METRICS_FILE, read_records

MSS = 1448
"""TCP payload per segment on a 1500-byte MTU (timestamps on)."""
INITIAL_WINDOW = 10 * MSS
MIN_RTO_S = 0.2


@dataclass(frozen=True)
class Link:
    one_way_s: float
    rate_bps: float | None
    """Bits per second; None: as fast as the machine."""

    @property
    def rtt_s(self) -> float:
        return 2 * self.one_way_s

    def serialize_s(self, nbytes: float) -> float:
        return 0.0 if self.rate_bps is None else nbytes * 8 / self.rate_bps

    def slow_start_s(self, nbytes: float) -> float:
        """The round trips a connection starting from the initial window waits before its
        window covers `nbytes` (or the bandwidth-delay product, past which the rate limits)."""
        if nbytes <= INITIAL_WINDOW:
            return 0.0
        covered = nbytes
        if self.rate_bps is not None:
            covered = min(nbytes, self.rate_bps / 8 * self.rtt_s)
        rounds = math.ceil(math.log2(max(covered, 1.0) / INITIAL_WINDOW + 1)) - 1
        return max(0, rounds) * self.rtt_s

    @property
    def rto_s(self) -> float:
        """Linux's retransmission timeout on a quiet path: the round trip plus 200 ms. A
        connection idle for longer restarts from a small window (tcp_slow_start_after_idle)."""
        return self.rtt_s + MIN_RTO_S


def parse_rate(rate: str | None) -> float | None:
    """A tc rate (`10mbit`, `1gbit`, `500kbit`, `none`) in bits per second."""
    if rate is None or rate == "none":
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            value = float(rate[: -len(unit)])
            if not math.isfinite(value) or value <= 0:
                break
            return value * scale
    raise ValueError(f"not a rate: {rate!r} (e.g. 10mbit, 1gbit, none)")


# --------------------------------------------------------------------------- reading a run


# --------------------------------------------------------------------------- reading a run


def run_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no {METRICS_FILE} in {run_dir}")
    return read_records(path)


def run_summary(run_dir: Path) -> dict[str, Any]:
    rows = [r for r in run_records(run_dir) if r.get("kind") == "summary"]
    if not rows:
        raise ValueError(f"no summary in {run_dir / METRICS_FILE}: did the run finish?")
    return rows[-1]


def run_steps(run_dir: Path, key: str) -> list[dict[str, Any]]:
    return [r for r in run_records(run_dir) if r.get("kind") == "metrics" and key in r]


def run_config(run_dir: Path) -> dict[str, Any]:
    """The resolved config of a run (Hydra's `.hydra/config.yaml`, beside it or above it)."""
    for folder in (run_dir, run_dir.parent):
        path = folder / ".hydra" / "config.yaml"
        if path.is_file():
            config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            assert isinstance(config, dict)
            return {str(k): v for k, v in config.items()}
    raise ValueError(f"no .hydra/config.yaml at {run_dir} or above it")
