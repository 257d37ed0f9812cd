"""The plots of a run, drawn from its run directory's metrics.jsonl when the run ends: each
experiment's manifest draws its own (`Manifest.plots`) with the helpers here.

`draw_run(run_dir, job)` is called by the tracker on a successful close, and by
`labtools.report` for runs that have none yet. Every plot is a PNG beside the metrics it shows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lab import registry

log = logging.getLogger(__name__)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_rows(records: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r.get("kind") == "metrics" and "step" in r and all(k in r for k in keys)
    ]


def smoothed(values: list[float], *, decay: float = 0.9) -> list[float]:
    """An exponential moving average, bias-corrected so its first points are not pulled to 0."""
    average, out = 0.0, []
    for n, value in enumerate(values, start=1):
        average = decay * average + (1 - decay) * value
        out.append(average / (1 - decay**n))
    return out


def save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_run(run_dir: Path, job: str) -> list[Path]:
    """The plots of run `job` in `run_dir`, as its experiment's manifest draws them (none for a
    job that is no experiment, or one without plots or without data)."""
    manifest = registry.find(job)
    if manifest is None or manifest.plots is None:
        return []
    return manifest.plots(Path(run_dir))
