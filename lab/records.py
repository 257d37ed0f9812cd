"""The files a run writes its records to, their reader, and the comparisons of two runs' records
that the experiments' manifests declare: what the tracker writes and the plots, the report and
the harness read (a floor below all of them)."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
OUTPUTS_FILE = "outputs.jsonl"
"""What a generating run produced: one JSON object per prompt (its new token ids and text)."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records a Tracker wrote to `path` (its metrics.jsonl or outputs.jsonl), in order. A
    line a killed process left half-written is skipped, with a warning: what it held is lost,
    the rest of the run's records are not."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            log.warning("%s:%d: a half-written record (a crash?), skipped", path, number)
    return records


LOSS_RTOL = 1e-4
"""How far a loss across hosts may stray from the same run's on loopback (relative)."""


def output_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's outputs.jsonl rows; none if it wrote none."""
    path = run_dir / OUTPUTS_FILE
    return read_records(path) if path.is_file() else []


def step_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's per-step rows (`kind: metrics`); none if it wrote no metrics file."""
    path = run_dir / METRICS_FILE
    records = read_records(path) if path.is_file() else []
    return [r for r in records if r.get("kind") == "metrics"]


def metric_values(run_dir: Path, key: str) -> list[float]:
    """Every numeric `key` of the run's per-step rows, in order."""
    return [float(r[key]) for r in step_metrics(run_dir) if isinstance(r.get(key), int | float)]


def same_outputs(hosts_dir: Path, local_dir: Path) -> tuple[bool, str]:
    """Two generating runs produced the same tokens, prompt for prompt."""
    ours, theirs = output_rows(hosts_dir), output_rows(local_dir)
    if not ours or not theirs:
        return False, f"no outputs.jsonl to compare ({len(ours)} rows across hosts, {len(theirs)})"
    equal = sum(a["tokens"] == b["tokens"] for a, b in zip(ours, theirs, strict=False))
    same = equal == len(ours) == len(theirs)
    return same, f"{equal} of {len(theirs)} generations token for token as on loopback"


def same_losses(key: str, rtol: float = LOSS_RTOL) -> Callable[[Path, Path], tuple[bool, str]]:
    """A comparison of two runs' `key` values, step for step, within `rtol` (relative)."""

    def compare(hosts_dir: Path, local_dir: Path) -> tuple[bool, str]:
        ours, theirs = metric_values(hosts_dir, key), metric_values(local_dir, key)
        if not ours or len(ours) != len(theirs):
            return False, f"{len(ours)} {key} values across hosts, {len(theirs)} on loopback"
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, theirs, strict=True))
        same = worst <= rtol and all(map(math.isfinite, ours))
        return same, (
            f"{len(ours)} {key} values, largest relative difference {worst:.1e} "
            f"(tolerance {rtol:.0e})"
        )

    return compare
