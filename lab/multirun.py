"""A multirun's summary: one table of every job, by the values it swept, and its headline metrics.

`python -m fed_learn -m fed.strategy=fedavg,ffa` runs one job per value; each job's own table
already names its settings (lab.tracking). `MultirunSummary`, a Hydra callback every entry
point's config registers (`conf/config.yaml`, `hydra.callbacks`), collects what each job
returned and, when the sweep ends, prints one table: a row per job, a column per key whose value
differs between jobs, then the metrics every job reported (a failed job says so in its row), and
writes it as `summary.csv` and `summary.md` in the sweep's folder, beside the jobs' numbered
folders.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

JOB_LABEL_ENV = "LAB_JOB_LABEL"
"""A multirun job's settings (`fed.strategy=ffa`), set for its processes (lab.experiment.main):
the final-metrics table each prints names them (lab.tracking)."""
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
MAX_METRICS = 8
"""Metric columns shown (the first a job reported, in its order): a table that fits a terminal."""


def job_label(overrides: Sequence[str], swept: Sequence[str] = ()) -> str:
    """A job's settings as a user typed them, Hydra's own left out: `fed.strategy=ffa seed=1`;
    only the keys in `swept` where it names any (what tells this job from the others)."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in overrides]
    return " ".join(
        o for o, key in zip(overrides, keys, strict=True)
        if not key.startswith("hydra") and (not swept or key in swept)
    )  # fmt: skip


def swept_keys(jobs: Sequence[Mapping[str, str]]) -> list[str]:
    """The keys whose value differs between `jobs` (each a key -> value mapping), in the order
    they were first given."""
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job if k not in keys]
    return [k for k in keys if len({job.get(k, "") for job in jobs}) > 1]


def sweep_keys(arguments: Sequence[str]) -> list[str]:
    """The keys a multirun's command line sweeps (`seed=0,1`, `x=range(3)`, `+k=glob(*)`), in
    Hydra's own reading of them; [] where none parses as a sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    candidates = [a for a in arguments if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(candidates)
    except HydraException:
        return []
    return [o.key_or_group for o in overrides if o.is_sweep_override()]


def is_comparison(metric: str) -> bool:
    """A metric that sets the run against its baseline: `x_over_y`, a ratio, a speedup."""
    return "_over_" in metric or metric.endswith("ratio") or metric.startswith("speedup")


def summary_rows(
    jobs: Sequence[tuple[Mapping[str, str], Mapping[str, Any] | None]],
    first: Sequence[str] = (),
    *,
    readable: bool = True,
) -> tuple[list[str], list[str], list[list[str]]]:
    """(swept keys, metric names, rows) of the summary: each job's swept values, then its
    metrics, those named in `first` (the experiment's headline and workload figures) ahead of the
    comparisons with a baseline (`is_comparison`), ahead of the rest; a job that returned none:
    `failed`. `readable`: numbers in their unit's fixed precision (lab.tables), for people; else
    as Python writes them, for a CSV."""
    settings = [values for values, _ in jobs]
    keys = swept_keys(settings) or ["job"]
    reported: list[str] = []
    for _, returned in jobs:
        for name, value in (returned or {}).items():
            if name not in reported and isinstance(value, int | float):
                reported.append(name)
    metrics = [m for m in dict.fromkeys(first) if m in reported]
    # then each run's answer against its baseline (federated_over_centralized, latency_ratio),
    # which the cut to MAX_METRICS must not drop, then the rest in the jobs' order
    metrics += [m for m in reported if m not in metrics and is_comparison(m)]
    metrics = (metrics + [m for m in reported if m not in metrics])[:MAX_METRICS]
    rows = []
    for number, (values, returned) in enumerate(jobs):
        row = [values.get(k, str(number)) for k in keys]
        if returned is None:
            row += ["failed"] + [""] * (len(metrics) - 1) if metrics else ["failed"]
        else:
            row += [_number(returned.get(name), name, readable) for name in metrics]
        rows.append(row)
    return keys, metrics, rows


def _number(value: Any, name: str, readable: bool) -> str:
    """`value` in the fixed precision of metric `name`'s unit (lab.tables), or as it is."""
    from lab.tables import fixed, unit_of

    if value is None:
        return ""
    return fixed(value, unit_of(name)) if readable else str(value)


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


class MultirunSummary(Callback):
    """Hydra callback: each job's settings and returned metrics; one table when the sweep ends."""

    def __init__(self) -> None:
        self.jobs: list[tuple[dict[str, str], Mapping[str, Any] | None]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs = []

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        from lab import registry

        overrides = [o for o in (job_return.overrides or []) if not o.startswith("hydra")]
        values = dict(o.split("=", 1) for o in overrides if "=" in o)
        returned = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if not isinstance(returned, Mapping):
            self.jobs.append((values, None))
            return
        returned = dict(returned)
        manifest = registry.find(str(config.hydra.job.name))
        if manifest is not None and manifest.headline.key not in returned:
            # the figure the experiment is judged by, from the job's own records
            with contextlib.suppress(OSError, KeyError, ValueError):
                headline = manifest.headline
                returned[headline.key] = headline.read(Path(job_return.working_dir))
        self.jobs.append((values, returned))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.jobs:
            return
        from rich.table import Table

        from lab import registry
        from lab.tables import print_wide, unit_of

        manifest = registry.find(str(config.hydra.job.name))
        first = (
            []
            if manifest is None
            else [manifest.headline.key] + [m.key for m in manifest.workload.metrics]
        )
        keys, metrics, rows = summary_rows(self.jobs, first)
        _, _, raw = summary_rows(self.jobs, first, readable=False)
        folder = Path(str(config.hydra.sweep.dir))
        folder.mkdir(parents=True, exist_ok=True)
        buffer = io.StringIO()
        csv.writer(buffer).writerows([keys + metrics, *raw])
        (folder / SUMMARY_CSV).write_text(buffer.getvalue())
        header = keys + [f"{m} ({unit_of(m)})" if unit_of(m) else m for m in metrics]
        (folder / SUMMARY_MD).write_text(markdown(header, rows))
        table = Table(title=f"{config.hydra.job.name}: {len(rows)} jobs", title_justify="left")
        for number, name in enumerate(header):
            table.add_column(name, justify="left" if number < len(keys) else "right",
                             overflow="fold")  # fmt: skip
        for row in rows:
            table.add_row(*row)
        print_wide(table)
        print(f"summary: {folder / SUMMARY_CSV}")
