"""One metrics tracker for every module: JSONL always, W&B when enabled, a table on the console.

`metrics.jsonl` in the run directory gets one JSON object per `log()` call and one per
`summary()`; it is flushed on every write, so a crash loses nothing already logged. W&B runs
offline (a directory under `<run_dir>/wandb`, to `wandb sync` later) unless this machine has
W&B configured, and can be turned off with `tracking.wandb=false`.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import shlex
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from lab import redact, registry
from lab.config import LabConfig, TrackingConfig
from lab.multirun import JOB_LABEL_ENV
from lab.plots import draw_run
from lab.records import METRICS_FILE, OUTPUTS_FILE, read_records  # noqa: F401  (their home before)
from lab.tables import fixed, print_wide, unit_of

log = logging.getLogger(__name__)

CONFIG_FILE = "resolved_config.yaml"
RUN_FILE = "lab_run.json"
"""What ran in a run directory: the job, its command line, when, and on which machine."""


def wandb_configured() -> bool:
    """Whether this machine can log to W&B online (API key in the env or in ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return bool(auth and auth[2])


def resolve_wandb_mode(mode: str) -> Literal["online", "offline", "disabled"]:
    """`auto` -> the user's WANDB_MODE if set, else online when configured, else offline."""
    if mode in ("online", "offline"):
        return mode  # type: ignore[return-value]
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode in ("online", "offline", "disabled"):
        return env_mode  # type: ignore[return-value]
    return "online" if wandb_configured() else "offline"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them readable
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalars
        return _jsonable(value.item())
    return value


class Tracker:
    """Logs a run's metrics to `<run_dir>/metrics.jsonl`, W&B and the console."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: Mapping[str, Any],
        tracking: TrackingConfig,
        job: str,
        name: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking = tracking
        self.job = job
        self._started = time.time()
        self._final: dict[str, Any] = {}
        config = redact.redact_config(config)  # in every record of the run, the secret is ***
        (self.run_dir / CONFIG_FILE).write_text(OmegaConf.to_yaml(dict(config)))
        self._write_run_file()
        self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        if self._jsonl.tell() and not (self.run_dir / METRICS_FILE).read_bytes().endswith(b"\n"):
            self._jsonl.write("\n")  # a resumed run after a kill mid-line: its rows start clean
        self._wandb_run = None
        if tracking.wandb:
            self._wandb_run = self._start_wandb(config, name=name)

    @classmethod
    def from_settings(cls, settings: LabConfig, *, job: str, name: str | None = None) -> Tracker:
        config = asdict(settings) if is_dataclass(settings) else dict(settings)
        return cls(
            settings.paths.run_dir, config=config, tracking=settings.tracking, job=job, name=name
        )

    def _start_wandb(self, config: Mapping[str, Any], *, name: str | None):
        import wandb

        mode = resolve_wandb_mode(self.tracking.wandb_mode)
        if mode == "disabled":
            return None
        redact.scrub_argv()  # W&B records sys.argv as the run's command (wandb-metadata.json)
        run = wandb.init(
            project=self.tracking.project,
            entity=self.tracking.entity,
            dir=str(self.run_dir),
            config=dict(config),
            mode=mode,
            job_type=self.job,
            name=name,
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        # Our steps are the runs' own (round, batch, optimizer step); one run may log two series
        # over the same steps (split vs unsplit), which W&B's own step, strictly increasing,
        # would drop: plot every metric against ours instead.
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        if mode == "offline":  # the folder `wandb sync` takes is the run's, above its files/
            log.info("W&B offline run in %s", Path(run.dir).parent)
        else:
            log.info("W&B run: %s", run.url)
        return run

    def _write_run_file(self) -> None:
        import sys

        from lab.machine import Machine

        module = Path(sys.argv[0]).parent.name if sys.argv[0].endswith("__main__.py") else None
        program = ["python", "-m", module] if module else ["python", sys.argv[0]]
        command = [*program, *redact.redact_argv(sys.argv[1:])]
        record = {
            "job": self.job,
            "command": shlex.join(command),  # pasted into a shell, it runs as it ran
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._started)),
            "machine": Machine.probe().as_dict(),
        }
        (self.run_dir / RUN_FILE).write_text(json.dumps(record, indent=2))

    @property
    def wandb_dir(self) -> Path | None:
        """The W&B run's own directory (offline runs: `<run_dir>/wandb/offline-run-*`)."""
        return None if self._wandb_run is None else Path(self._wandb_run.dir).parent

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps({k: _jsonable(v) for k, v in record.items()}, allow_nan=False)
        self._jsonl.write(line + "\n")
        self._jsonl.flush()

    def log(self, metrics: Mapping[str, Any], *, step: int | None = None) -> None:
        """Record metrics at `step` (a round, a decoding step, a training step)."""
        record = {"kind": "metrics", "time_s": round(time.time() - self._started, 6)}
        if step is not None:
            record["step"] = step
        record.update(metrics)
        self._write(record)
        if self._wandb_run is not None:
            self._wandb_run.log({**metrics, **({} if step is None else {"step": step})})

    def summary(self, metrics: Mapping[str, Any]) -> None:
        """Record a run's final metrics (also printed as a table when the run closes)."""
        self._final.update(metrics)
        self._write({"kind": "summary", "time_s": round(time.time() - self._started, 6), **metrics})
        if self._wandb_run is not None:
            self._wandb_run.summary.update(dict(metrics))

    def outputs(self, rows: Iterable[Mapping[str, Any]]) -> Path:
        """Write what the run generated, one row per prompt, to `<run_dir>/outputs.jsonl`:
        what a user reads, and what two runs of the same settings compare by."""
        path = self.run_dir / OUTPUTS_FILE
        lines = [json.dumps({k: _jsonable(v) for k, v in row.items()}) for row in rows]
        path.write_text("".join(line + "\n" for line in lines))
        return path

    def print_table(self, console: Console | None = None) -> None:
        label = os.environ.get(JOB_LABEL_ENV, "")  # one job of a multirun: its settings
        title = f"{self.job}: final metrics" + (f" ({label})" if label else "")
        table = Table(title=title, title_justify="left", min_width=len(title))  # title whole
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("unit")
        for key, value in self._final.items():
            table.add_row(key, fixed(value, unit_of(key)), unit_of(key))
        print_wide(table, console)

    def close(self, *, failed: bool = False) -> None:
        if not self._jsonl.closed:
            self._jsonl.close()
        offline = None
        if self._wandb_run is not None:
            offline = self.wandb_dir if self._wandb_run.settings.mode == "offline" else None
            self._wandb_run.finish(exit_code=1 if failed else 0)
            self._wandb_run = None
        plots = [] if failed else self.draw_plots()
        if self.tracking.console and self._final and not failed:
            self.print_table()
        if self.tracking.console and not failed:
            for path in plots:
                print(f"plot: {path}")
            if self._final:  # what the figures mean, in words, last before the W&B line
                for line in registry.verdict_lines(self.job, self._final):
                    print(line)
            if offline is not None:
                print(f"W&B (offline): wandb sync {offline}")

    def draw_plots(self) -> list[Path]:
        """The job's own plots, beside its metrics (a plot that fails is a warning, not a
        failed run); returns their paths."""
        try:
            return draw_run(self.run_dir, self.job)
        except Exception as exc:
            log.warning("could not draw %s's plots in %s: %s", self.job, self.run_dir, exc)
            return []

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)
