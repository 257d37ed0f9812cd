"""Sweep a grid of settings over a registered experiment, one isolated process tree per cell.

`run_matrix.py` is the command (its config: `conf/matrix.yaml`, schema `MatrixConfig`). Each cell
is `python -m <experiment> <overrides>` started in its own POSIX session with its own run
directory (so its own free ports: the experiment's local plan picks them), under a time limit and
a memory cap on its whole process tree (an RSS watchdog: RLIMIT_AS counts torch's virtual
mappings and Linux ignores RLIMIT_RSS). A crash, a hang or an out-of-memory marks that cell
`error`, `timeout` or `oom`, with the reason, and the sweep goes on. Results are appended as each
cell finishes (`results.jsonl`, and `results.csv` rewritten from it) with the cell's settings,
its metrics (median and spread over the experiment's repeated measurements), the peak RSS of
every process of the cell, the machine and the status; a re-run skips the cells already there.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from lab import atomic, commandline, experiment, registry
from lab.cli import ConfigError
from lab.config import SECRET_ENV, check_fields_positive, register_schema
from lab.launch import die_with_parent, stop_groups
from lab.redact import redact_argv, redact_config, redact_text, split_secret
from lab.registry import Workload
from lab.tracking import METRICS_FILE, read_records

log = logging.getLogger(__name__)

RESULTS_JSONL = "results.jsonl"
RESULTS_CSV = "results.csv"
STATUSES = ("ok", "error", "timeout", "oom")


def workload_of(config: MatrixConfig) -> Workload:
    """How run_matrix sweeps the experiment `config.workload` (its manifest's workload)."""
    return registry.manifest(config.workload).workload


@dataclass
class MatrixConfig:
    """Schema of `conf/matrix.yaml`: what `python run_matrix.py` sweeps and how."""

    workload: str = ""
    """A registered experiment (lab.registry); conf/matrix.yaml's default: split_inference."""
    axes: dict[str, str] = field(default_factory=dict)
    """Short axis names -> the config key each sets (`context: generate.prompt_tokens`)."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Axis name (a key of `axes`) -> the values to sweep; every combination is a cell."""
    overrides: list[str] = field(default_factory=list)
    """Hydra overrides every cell gets (after the workload's own), e.g. `model=random_long`."""
    repeats: int = 3
    """Measurements per cell (after its warm-up); the table keeps their median and spread."""
    num_threads: int = 0
    """torch threads per process of a cell; 0 lets the experiment share the cores among its
    processes as it does for a local run."""
    timeout_s: float = 600.0
    """A cell still running after this is killed (its whole process tree) and marked timeout."""
    memory_mib: float = 0.0
    """A cell whose processes together hold more resident memory than this is killed and marked
    oom; 0: 80% of this machine's memory."""
    out_dir: str = "outputs/matrix/${workload}"
    cell: int = -1
    """Run only cell number `cell` (0-based, in grid order) and no plots: one job per cell for a
    Hydra launcher plugin (`--multirun cell=0,1,...`); -1 runs every cell, then draws."""
    retry_failed: bool = False
    """Re-run cells recorded with a failed status (a finished `ok` cell is never re-run)."""
    baseline_tolerance: float = 0.25
    """A cell whose baseline (the workload's, e.g. the target alone) differs by more than this
    share from the median of the cells that should measure the same one is flagged: the
    machine was busy, and its ratios are not comparable (`busy_baselines`)."""
    retry_flagged: bool = False
    """Re-run the cells flagged for their baseline, once, at the end of the sweep."""
    plot: bool = True
    wandb: bool = False
    """Also log the heatmaps (as images) and the results table to W&B (offline unless set up)."""

    def __post_init__(self) -> None:
        known = registry.manifests()
        if self.workload not in known:
            import difflib

            close = difflib.get_close_matches(self.workload, list(known), n=1)
            guess = f"did you mean {close[0]}? " if close else ""
            raise ValueError(
                f"workload={self.workload!r} is not one run_matrix can sweep; {guess}"
                f"choose one of {list(known)}"
            )
        check_fields_positive("matrix", self, ("repeats", "timeout_s", "baseline_tolerance"))
        if self.memory_mib < 0 or self.num_threads < 0:
            raise ValueError("memory_mib and num_threads must be >= 0")
        if not self.grid:
            raise ValueError("grid is empty: give at least one axis, e.g. grid.batch=[1,4]")
        for axis, values in self.grid.items():
            if axis not in self.axes:
                raise ValueError(
                    f"grid.{axis}: no such axis; known axes {sorted(self.axes)} (add one with "
                    f"+axes.{axis}=<config key>)"
                )
            if not values:
                raise ValueError(f"grid.{axis} has no values")


register_schema("matrix_schema", MatrixConfig)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: axis name -> value."""

    index: int
    values: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return ",".join(f"{axis}={value}" for axis, value in self.values)

    @property
    def slug(self) -> str:
        """The cell's folder name (no `=` or `,`: it travels in a Hydra override)."""
        parts = (f"{axis}-{value}" for axis, value in self.values)
        return re.sub(r"[^A-Za-z0-9_.-]", "_", "_".join(parts))


def cells(config: MatrixConfig) -> list[Cell]:
    """Every combination of the grid's values, first axis slowest."""
    axes = list(config.grid)
    combos = itertools.product(*(config.grid[axis] for axis in axes))
    return [Cell(i, tuple(zip(axes, combo, strict=True))) for i, combo in enumerate(combos)]


def sweep_fingerprint(config: MatrixConfig) -> str:
    """What makes two sweeps' cells the same measurement (not the grid: cells are per value)."""
    same = {
        "workload": config.workload,
        "axes": dict(config.axes),
        "overrides": redact_argv(config.overrides),  # the secret is no part of the measurement
        "repeats": config.repeats,
        "num_threads": config.num_threads,
    }
    return hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:12]


def check_sweep(config: MatrixConfig) -> None:
    """Refuse, before any cell runs, a key the workload's experiment does not read."""
    manifest = registry.manifest(config.workload)  # its record: no run.py imported
    keys = [config.axes[axis] for axis in config.grid]
    keys += [experiment.override_key(o) for o in config.overrides]
    experiment.refuse_unread(manifest, keys)
    # a key the schema does not have, a value of the wrong type: composed as the first cell's
    # config will be, each mistake one line (lab.commandline), never Hydra's advice
    first = cells(config)[0]
    overrides = [o for o in cell_overrides(config, first, Path("unused"))
                 if not o.startswith("hydra.run.dir=")]  # fmt: skip
    try:
        commandline.check(manifest.name, manifest.load_schema(), overrides,
                          config_dir=commandline.config_dir_of(manifest.name))  # fmt: skip
    except ConfigError as exc:
        refused = re.match(r"(\S+) is not a setting of", str(exc))
        axis = next((a for a in config.grid if refused and config.axes.get(a) == refused[1]), None)
        hint = (f" (grid.{axis} sweeps {config.axes[axis]}, which {config.workload} does not "
                f"have: ~grid.{axis} drops that axis, conf/matrix.yaml's default grid has it)"
                if axis else "")  # fmt: skip
        raise ConfigError(
            f"cell {first.name} of workload={config.workload} does not compose: "
            f"{redact_text(str(exc))}{hint}"
        ) from None


def cell_overrides(config: MatrixConfig, cell: Cell, run_dir: Path) -> list[str]:
    workload = workload_of(config)
    settings = {config.axes[axis]: value for axis, value in cell.values}
    for override in [*workload.base, *config.overrides]:
        key, _, value = override.partition("=")
        settings.setdefault(experiment.override_key(key), value)
    out = [*workload.base, *config.overrides]
    out += [f"{config.axes[axis]}={_hydra_value(value)}" for axis, value in cell.values]
    out += workload.repeat(settings, config.repeats)
    if config.num_threads:
        out.append(f"num_threads={config.num_threads}")
    out += [
        f"hydra.run.dir={run_dir}",
        "tracking.wandb=false",  # one W&B run per sweep (run_matrix's own), not one per cell
        "tracking.console=false",
    ]
    return out


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


# ---------------------------------------------------------------------------- running a cell


@dataclass
class CellOutcome:
    status: str
    reason: str = ""
    seconds: float = 0.0
    peak_rss_mib: dict[str, float] = field(default_factory=dict)
    """Peak RSS of each process of the cell, by role (`driver`, `stage1`, ...)."""
    peak_total_rss_mib: float = 0.0


FORK_GRACE_S = 2.0
"""A child younger than this without a `role=` may have only forked (its command line its
parent's, or empty mid-exec): it is not named (nor sampled) until it shows its own command, or
has lived this long."""


def _role_of(proc: psutil.Process, cell_pid: int, names: dict[int, str]) -> str | None:
    """The name a cell's process is reported under: `main`, its `role=` (`stage1`,
    `client0`), or, for a process started without one (torch's elastic workers, helpers), its
    nearest named ancestor's name and its rank (`main.rank1`) or its place among that
    ancestor's unnamed ones (`main.sub1`): the same columns in every cell, never a pid.
    `names` remembers each pid's name once known. None: a child younger than FORK_GRACE_S
    without a role (its name is not known yet)."""
    if proc.pid in names:
        return names[proc.pid]
    if proc.pid == cell_pid:
        return "main"
    try:
        args = proc.cmdline()
    except (psutil.Error, OSError):
        args = []
    role = next((a.split("=", 1)[1] for a in args if a.startswith("role=")), None)
    if role:  # read each time: a child just forked still shows its parent's command line
        rank = next((a.split("=", 1)[1] for a in args if a.startswith("split.rank=")), "")
        index = next((a.split("=", 1)[1] for a in args if a.startswith("client_index=")), "")
        return f"{role}{rank}{index}"
    try:
        parent = proc.parent()
    except psutil.Error:
        parent = None
    orphan = parent is None or parent.pid <= 1  # its parent gone: init took it in
    with contextlib.suppress(psutil.Error, OSError):
        if time.time() - proc.create_time() < FORK_GRACE_S:
            return None  # perhaps forked and about to exec a role: named on a later sample
    above = "main" if orphan or parent is None else _role_of(parent, cell_pid, names)
    if above is None:
        return None
    try:
        local_rank = proc.environ().get("LOCAL_RANK")
    except (psutil.Error, OSError):
        local_rank = None
    if local_rank is not None:
        name = f"{above}.rank{local_rank}"
    else:
        siblings = sum(n.startswith(f"{above}.sub") for n in names.values())
        name = f"{above}.sub{siblings + 1}"
    names[proc.pid] = name
    return name


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _kill_tree(processes: Sequence[psutil.Process]) -> None:
    """SIGKILL every process and its process group (roles lead their own groups)."""
    for proc in processes:
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError, OSError):
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        with contextlib.suppress(psutil.Error):
            proc.kill()


def node_name() -> str:
    """Which machine ran a cell: inside a Ray worker its node's address too (namespace hosts,
    and containers, share a hostname), elsewhere the hostname."""
    ray = sys.modules.get("ray")  # imported only where a Ray launcher runs the cell
    if ray is not None and ray.is_initialized():
        return f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
    return socket.gethostname()


def run_cell_process(
    argv: list[str],
    *,
    cwd: Path,
    log_path: Path,
    timeout_s: float,
    memory_mib: float,
    poll_s: float = 0.1,
    on_sample: Callable[[float], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> CellOutcome:
    """Run one cell's command in its own session, watching its whole process tree; `env` is
    added to this process's environment."""
    started = time.monotonic()
    peaks: dict[str, float] = {}
    names: dict[int, str] = {}
    peak_total = 0.0
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            # a cell outlives no sweep: a launcher's worker (Ray, submitit) killed mid-cell
            # takes the cell with it (its local launcher stops its roles on the SIGTERM)
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
        root = psutil.Process(proc.pid)
        seen: list[psutil.Process] = [root]
        status, reason = "ok", ""
        try:
            while proc.poll() is None:
                tree = _tree(root)
                seen += [p for p in tree if p not in seen]
                total = 0.0
                for member in tree:
                    try:
                        rss = member.memory_info().rss / 2**20
                    except psutil.Error:
                        continue
                    if rss == 0:  # a zombie, waiting for its parent to reap it: no column
                        continue
                    total += rss
                    role = _role_of(member, proc.pid, names)
                    if role is not None:
                        peaks[role] = max(peaks.get(role, 0.0), rss)
                peak_total = max(peak_total, total)
                if on_sample is not None:
                    on_sample(total)
                if total > memory_mib:
                    status = "oom"
                    reason = f"its processes held {total:,.0f} MiB > the {memory_mib:,.0f} MiB cap"
                    break
                if time.monotonic() - started > timeout_s:
                    status, reason = "timeout", f"still running after {timeout_s:.0f}s"
                    break
                time.sleep(poll_s)
        finally:
            _kill_tree([*_tree(root), *seen])
            stop_groups([proc], grace_s=0, first=signal.SIGKILL)
    if status == "ok" and proc.returncode != 0:
        status, reason = "error", _failure_reason(log_path, proc.returncode)
    return CellOutcome(
        status,
        reason,
        seconds=time.monotonic() - started,
        peak_rss_mib=peaks,
        peak_total_rss_mib=peak_total,
    )


def _failure_reason(log_path: Path, returncode: int) -> str:
    """The most telling line of a failed cell's log: its last error line, else its last line."""
    boilerplate = ("Set the environment variable HYDRA_FULL_ERROR", "See https://hydra.cc/")
    lines = [
        line for line in _tail(log_path, 80) if line.strip() and not line.startswith(boilerplate)
    ]
    errors = [
        line
        for line in lines
        if re.search(r"(Error|Exception|error:|Killed|Traceback)", line)
        and not line.startswith("Error executing job with overrides")
    ]
    pick = (errors or lines or [f"exit code {returncode}"])[-1].strip()
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exit {returncode}"
    return f"{how}: {pick[:300]}"


def _tail(path: Path, count: int) -> list[str]:
    with contextlib.suppress(OSError):
        data = path.read_bytes()[-20_000:]
        return data.decode(errors="replace").splitlines()[-count:]
    return []


def summarize_cell(run_dir: Path) -> dict[str, float]:
    """The cell's metrics from its run's metrics.jsonl: the summary, with every metric the run
    also logged per step replaced by its median over the steps (plus `<key>_spread`: max-min
    over median, and `<key>_n`)."""
    records = read_records(run_dir / METRICS_FILE)
    summaries = [r for r in records if r.get("kind") == "summary"]
    if not summaries:
        raise ValueError(f"{run_dir / METRICS_FILE} has no summary record")
    metrics = {
        k: float(v) for k, v in summaries[-1].items() if k not in ("kind", "time_s") and _num(v)
    }
    steps: dict[str, list[float]] = {}
    for record in records:
        if record.get("kind") != "metrics":
            continue
        for key, value in record.items():
            if key not in ("kind", "step", "time_s") and _num(value):
                steps.setdefault(key, []).append(float(value))
    for key, values in steps.items():
        if len(values) < 2:
            continue
        median = statistics.median(values)
        metrics[key] = median
        metrics[f"{key}_spread"] = (max(values) - min(values)) / median if median else 0.0
        metrics[f"{key}_n"] = float(len(values))
    stages = [v for k, v in metrics.items() if re.fullmatch(r"stage\d+_peak_rss_mib", k)]
    if stages:
        metrics["max_stage_peak_rss_mib"] = max(stages)
    return metrics


def _baseline_groups(
    records: Sequence[Mapping[str, Any]],
    workload: Workload,
    axes: Mapping[str, str],
    tolerance: float,
) -> list[tuple[float, list[Mapping[str, Any]], list[Mapping[str, Any]]]]:
    """(median, members, those off the median by more than `tolerance`) for each group of at
    least 3 ok cells that should measure the same baseline."""
    key = workload.baseline
    if not key:
        return []

    def free(axis: str) -> bool:
        config_key = axes.get(axis, axis)
        return any(config_key == k or (k.endswith(".") and config_key.startswith(k))
                   for k in workload.baseline_free)  # fmt: skip

    groups: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
    for record in records:
        if record.get("status") != "ok" or not _num(record.get("metrics", {}).get(key)):
            continue
        settings = record.get("settings", {})
        group = tuple(f"{a}={settings[a]}" for a in sorted(settings) if not free(a))
        groups.setdefault(group, []).append(record)
    found = []
    for members in groups.values():
        if len(members) < 3:
            continue
        median = statistics.median(float(m["metrics"][key]) for m in members)
        off = [
            m for m in members
            if median > 0 and abs(float(m["metrics"][key]) - median) / median > tolerance
        ]  # fmt: skip
        found.append((median, members, off))
    return found


def busy_baselines(
    records: Sequence[Mapping[str, Any]],
    workload: Workload,
    axes: Mapping[str, str],
    tolerance: float,
) -> dict[str, str]:
    """The cells whose baseline looks measured on a busy machine, each with why: its baseline
    metric differs by more than `tolerance` (a share) from the median of the cells of its
    group (cells whose settings differ only in axes the baseline does not depend on,
    `Workload.baseline_free`), in groups of at least 3 ok cells, and it is one of a few: where
    half the group or more is off its median there is no steady baseline to be off from, and
    no cell is singled out (`unsteady_baselines` says so instead). {} when the workload has no
    baseline."""
    key = workload.baseline
    flags = {}
    for median, members, off in _baseline_groups(records, workload, axes, tolerance):
        if 2 * len(off) >= len(members):
            continue
        for record in off:
            value = float(record["metrics"][key])
            flags[str(record["cell"])] = (
                f"{record['cell']}: baseline {key} {value:,.4g} against a median of "
                f"{median:,.4g} over the {len(members)} cells that should measure the same "
                f"({abs(value - median) / median:.0%} off): the "
                "machine was likely busy, so its ratios are not comparable "
                "(retry_flagged=true runs it again)"
            )
    return flags


def unsteady_baselines(
    records: Sequence[Mapping[str, Any]],
    workload: Workload,
    axes: Mapping[str, str],
    tolerance: float,
) -> list[str]:
    """A remark for each group of cells that should measure the same baseline where half or
    more are off their median by more than `tolerance`: the machine's speed moved during the
    sweep, and no one cell can be blamed."""
    key, remarks = workload.baseline, []
    for _median, members, off in _baseline_groups(records, workload, axes, tolerance):
        if 2 * len(off) < len(members):
            continue
        values = sorted(float(m["metrics"][key]) for m in members)
        remarks.append(
            f"baseline {key} ranges {values[0]:,.4g} to {values[-1]:,.4g} over "
            f"{', '.join(str(m['cell']) for m in members)}, which should measure the same "
            f"({len(off)} of {len(members)} more than {tolerance:.0%} off their median): the "
            "machine's speed moved during the sweep, so compare its ratios, not its tokens/s "
            "or ms, and rerun it on a quiet machine for those"
        )
    return remarks


def _num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------- the results table


class Results:
    """`results.jsonl` (appended, one record per finished cell) and `results.csv` (rewritten
    from it). Safe for several cell jobs writing at once (a file lock)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / RESULTS_JSONL
        self.csv = self.out_dir / RESULTS_CSV

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.out_dir / ".results.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def records(self) -> list[dict[str, Any]]:
        if not self.jsonl.is_file():
            return []
        out = []
        for line in self.jsonl.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a crash
                out.append(json.loads(line))
        return out

    def latest(self, fingerprint: str) -> dict[str, dict[str, Any]]:
        """The last record of each cell of this sweep, by cell name."""
        return {r["cell"]: r for r in self.records() if r.get("sweep") == fingerprint}

    def append(self, record: dict[str, Any]) -> None:
        with self._locked():
            with open(self.jsonl, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record, allow_nan=False) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            self._write_csv()

    def _write_csv(self) -> None:
        rows = [flatten(r) for r in self.records()]
        columns: list[str] = []
        for row in rows:
            columns += [c for c in row if c not in columns]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        atomic.write_text(self.csv, buffer.getvalue())


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def clean_json(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value


def run_cell(
    config: MatrixConfig,
    cell: Cell,
    *,
    machine: Mapping[str, Any],
    results: Results,
    on_sample: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Run one cell, append its record to the results, and return the record. The cell inherits
    this process's environment, so `LAB_PLACEMENT` (lab.experiment) places its roles."""
    out_dir = Path(config.out_dir).resolve()
    run_dir = out_dir / "cells" / cell.slug
    if run_dir.exists():  # a leftover of an interrupted or retried run: start clean
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    argv = [sys.executable, "-m", config.workload, *cell_overrides(config, cell, run_dir)]
    argv, secret = split_secret(argv)  # a secret the overrides hold goes in the environment
    memory_mib = config.memory_mib or 0.8 * psutil.virtual_memory().total / 2**20
    outcome = run_cell_process(
        argv,
        cwd=Path.cwd(),
        log_path=run_dir / "cell.log",
        timeout_s=config.timeout_s,
        memory_mib=memory_mib,
        on_sample=on_sample,
        env={SECRET_ENV: secret} if secret else None,
    )
    metrics: dict[str, float] = {}
    if outcome.status == "ok":
        try:
            metrics = summarize_cell(run_dir)
        except (OSError, ValueError) as exc:
            outcome.status, outcome.reason = "error", f"no metrics: {exc}"
    record = clean_json(
        {
            "sweep": sweep_fingerprint(config),
            "workload": config.workload,
            "cell": cell.name,
            "index": cell.index,
            "settings": dict(cell.values),
            "status": outcome.status,
            "reason": outcome.reason,
            "seconds": round(outcome.seconds, 2),
            "metrics": metrics,
            "peak_rss_mib": {k: round(v, 1) for k, v in outcome.peak_rss_mib.items()},
            "peak_total_rss_mib": round(outcome.peak_total_rss_mib, 1),
            "repeats": config.repeats,
            "run_dir": str(run_dir),
            "command": argv,
            "machine": dict(machine),
            "time": time.time(),
        }
    )
    record = redact_config(record)  # its reason may quote the cell's log, which quotes overrides
    results.append(record)
    return record
