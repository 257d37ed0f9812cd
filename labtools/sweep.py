"""run_matrix's sweep: run the grid's cells not yet recorded, flag busy baselines, print the
table, draw the heatmaps (and log them to W&B); or hand the cells to a Hydra launcher plugin
(`farm`). `run_matrix.py` is its Hydra face; tests call `sweep` directly.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lab.cli import ConfigError
from lab.config import CONF_DIR
from lab.launch import stop_groups
from lab.machine import Machine
from lab.redact import redact_argv, redact_config, scrub_argv
from lab.tables import print_wide
from labtools import matrix
from labtools.heatmaps import draw

FARM_GRACE_S = 60.0
"""After Ctrl-C, how long the launcher gets to stop its jobs before it is terminated."""


def sweep(
    config: matrix.MatrixConfig, *, console: Console | None = None, run: bool = True
) -> list[dict[str, Any]]:
    """Run the cells not yet in the results (all of them, or just `config.cell`), then draw;
    with `run=False` (their jobs ran elsewhere) only draw.

    Returns the sweep's latest record per cell, in grid order."""
    console = console or Console()
    matrix.check_sweep(config)  # a key the workload ignores is refused before any cell runs
    out_dir = Path(config.out_dir).resolve()
    results = matrix.Results(out_dir)
    fingerprint = matrix.sweep_fingerprint(config)
    grid_cells = matrix.cells(config)
    if config.cell >= 0:
        if config.cell >= len(grid_cells):
            raise ConfigError(f"cell={config.cell}: the grid has {len(grid_cells)} cells")
        grid_cells = [grid_cells[config.cell]]
    write_sweep_file(config, out_dir)
    done = results.latest(fingerprint)
    todo = [
        cell
        for cell in grid_cells
        if run
        and (cell.name not in done or (config.retry_failed and done[cell.name]["status"] != "ok"))
    ]
    machine = {**Machine.probe().as_dict(), "node": matrix.node_name()}
    console.print(
        f"run_matrix: {config.workload}, {len(matrix.cells(config))} cells "
        f"({' x '.join(f'{a}={v}' for a, v in config.grid.items())}); "
        f"{len(grid_cells) - len(todo)} already done, {len(todo)} to run; results in {out_dir}"
    )
    progress = Progress(
        TextColumn("[bold]cells"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[cell]}"),
        TextColumn("[dim]{task.fields[rss]}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task("cells", total=len(todo), cell="", rss="")
        for cell in todo:
            progress.update(task, cell=cell.name, rss="")

            def sampled(total_mib: float) -> None:
                progress.update(task, rss=f"{total_mib:,.0f} MiB")

            record = matrix.run_cell(
                config, cell, machine=machine, results=results, on_sample=sampled
            )
            if record["status"] != "ok":
                progress.console.print(
                    f"[yellow]{cell.name}: {record['status']}[/] ({record['reason']})"
                )
            progress.advance(task)
    latest = results.latest(fingerprint)
    records = [latest[c.name] for c in matrix.cells(config) if c.name in latest]
    flags = flagged(config, records)
    if flags and config.retry_flagged and config.cell < 0 and run:
        again = [c for c in grid_cells if c.name in flags]
        console.print(f"[yellow]{len(again)} cells with a baseline off their group's: "
                      "running them again[/]")  # fmt: skip
        for cell in again:
            matrix.run_cell(config, cell, machine=machine, results=results)
        latest = results.latest(fingerprint)
        records = [latest[c.name] for c in matrix.cells(config) if c.name in latest]
        flags = flagged(config, records)
    for reason in flags.values():
        console.print(f"[yellow]flagged[/] {reason}", soft_wrap=True)
    if config.cell < 0:
        print_wide(results_table(config, records, flags), console)
        if config.plot:
            paths = draw(
                records,
                matrix.workload_of(config).metrics,
                grid=config.grid,
                axes=config.axes,
                out_dir=out_dir / "heatmaps",
                title=config.workload,
                flagged=set(flags),
            )
            console.print(f"heatmaps: {len(paths)} PNG files in {out_dir / 'heatmaps'}")
            if config.wandb:
                log_to_wandb(config, records, paths, out_dir)
    return records


def flagged(config: matrix.MatrixConfig, records: list[dict[str, Any]]) -> dict[str, str]:
    """The cells whose baseline is off their group's (matrix.busy_baselines), with why."""
    workload = matrix.workload_of(config)
    return matrix.busy_baselines(records, workload, config.axes, config.baseline_tolerance)


def command_of(config: matrix.MatrixConfig) -> str:
    """The command line that runs this sweep again (and skips what is done), as a shell takes
    it: the grid's and axes' entries that conf/matrix.yaml lacks with `+`, those it has that
    the sweep dropped with `~`, every word quoted where the shell would read it. A secret shows
    as `***`, which the cells read from LAB_SECRET."""
    default = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "matrix.yaml"), resolve=False)
    assert isinstance(default, dict)
    words = [f"workload={config.workload}"]
    words += _entries("axes", default.get("axes") or {}, config.axes, str)
    words += _entries("grid", default.get("grid") or {}, config.grid, matrix._hydra_value)
    quoted = ",".join(_hydra_quoted(o) for o in redact_argv(config.overrides))
    words += [f"overrides=[{quoted}]", f"repeats={config.repeats}"]
    schema = matrix.MatrixConfig.__dataclass_fields__
    for name in ("num_threads", "timeout_s", "memory_mib", "baseline_tolerance", "retry_failed",
                 "retry_flagged", "plot", "wandb"):  # fmt: skip
        value = getattr(config, name)
        if value != default.get(name, schema[name].default):
            words.append(f"{name}={matrix._hydra_value(value)}")
    words.append(f"out_dir={config.out_dir}")
    return "python run_matrix.py " + shlex.join(words)


def _entries(
    name: str, default: Mapping[str, Any], given: Mapping[str, Any], shown: Any
) -> list[str]:
    """Overrides that turn mapping `default` into `given`: `name.k=v` for a key it has,
    `+name.k=v` for a new one, `~name.k` for one dropped."""
    words = [f"~{name}.{key}" for key in default if key not in given]
    for key, value in given.items():
        if key not in default:
            words.append(f"+{name}.{key}={shown(value)}")
        elif value != default[key]:
            words.append(f"{name}.{key}={shown(value)}")
    return words


def _hydra_quoted(text: str) -> str:
    """`text` as one quoted element of a Hydra list (its quotes and backslashes escaped)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_sweep_file(config: matrix.MatrixConfig, out_dir: Path) -> None:
    from lab import atomic
    from labtools.report import SWEEP_FILE

    record = {
        "workload": config.workload,
        "command": command_of(config),
        "grid": config.grid,
        "axes": config.axes,
        "metrics": [m.key for m in matrix.workload_of(config).metrics],
        "baseline_tolerance": config.baseline_tolerance,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out_dir / SWEEP_FILE, json.dumps(record, indent=2))


def results_table(
    config: matrix.MatrixConfig, records: list[dict[str, Any]], flags: Mapping[str, str] = {}
) -> Table:
    """The sweep's table: a row per cell, its status (`ok, busy?` where its baseline is off its
    group's), the workload's first metrics with their units, its seconds."""
    from labtools.report import fixed

    metrics = matrix.workload_of(config).metrics[:4]
    table = Table(title=f"run_matrix: {config.workload}", title_justify="left")
    for axis in config.grid:
        table.add_column(axis, justify="right", overflow="fold")
    table.add_column("status", overflow="fold")
    for metric in metrics:
        table.add_column(f"{metric.key} ({metric.unit})", justify="right", overflow="fold")
    table.add_column("time (s)", justify="right")
    for record in records:
        values = record["metrics"]
        status = record["status"]
        table.add_row(
            *(str(record["settings"][axis]) for axis in config.grid),
            (f"[yellow]{status}, busy?" if record["cell"] in flags else status)
            if status == "ok" else f"[red]{status}",
            *(fixed(values[m.key], m.unit) if m.key in values else "" for m in metrics),
            f"{record['seconds']:.0f}",
        )  # fmt: skip
    return table


def log_to_wandb(
    config: matrix.MatrixConfig, records: list[dict[str, Any]], paths: list[Path], out_dir: Path
) -> None:
    """The heatmaps as images and the results as a table, in one W&B run (offline unless set up)."""
    import wandb

    from lab.tracking import resolve_wandb_mode

    scrub_argv()  # W&B records sys.argv as the run's command
    config_record = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    run = wandb.init(
        project="distributed-llm-lab",
        job_type="run_matrix",
        dir=str(out_dir),
        mode=resolve_wandb_mode("auto"),
        config=redact_config(config_record),
        settings=wandb.Settings(silent=True, console="off"),
    )
    try:
        rows = [matrix.flatten(r) for r in records]
        names = sorted({c for row in rows for c in row if not c.startswith("machine.")})
        columns: list[str | int] = list(names)
        table = wandb.Table(
            columns=columns, data=[[str(row.get(c, "")) for c in names] for row in rows]
        )
        run.log({"results": table, **{f"heatmap/{p.stem}": wandb.Image(str(p)) for p in paths}})
    finally:
        run.finish()


def farm(
    config: matrix.MatrixConfig, launcher: str, console: Console, *, script: Path, hydra_config: Any
) -> int:
    """Hand the cells not yet done to `launcher`, one Hydra job a cell (`script --multirun
    cell=...`, `hydra_config` the running job's), and wait for them; returns the launcher's exit
    status (0 when nothing was left to do).

    Hydra launchers do not resume; this does: what is already in the results is not sent."""
    out_dir = Path(config.out_dir).resolve()
    matrix.check_sweep(config)  # refused here, before any node is asked for anything
    done = matrix.Results(out_dir).latest(matrix.sweep_fingerprint(config))
    todo = [
        cell.index
        for cell in matrix.cells(config)
        if cell.name not in done or (config.retry_failed and done[cell.name]["status"] != "ok")
    ]
    total = len(matrix.cells(config))
    console.print(
        f"run_matrix: {config.workload}, {total} cells; {total - len(todo)} already done, "
        f"{len(todo)} handed to {launcher.rsplit('.', 1)[-1]}; results in {out_dir}"
    )
    if not todo:
        return 0
    ours = ("cell", "plot", "out_dir")
    fixes = []
    ray_init = OmegaConf.select(hydra_config.launcher, "ray.init") or {}
    if ray_init.get("address") and "object_store_memory" not in ray_init:
        # hydra-ray-launcher 1.2.2 always sets object_store_memory, which Ray (2.x) refuses
        # when connecting to a running cluster: that is the cluster's own setting
        fixes.append("+hydra.launcher.ray.init.object_store_memory=null")
    argv = [
        sys.executable,
        str(script),
        "--multirun",
        *(o for o in hydra_config.overrides.hydra if not o.startswith("hydra.mode=")),
        *fixes,
        *(o for o in hydra_config.overrides.task if o.lstrip("+~").split("=")[0] not in ours),
        f"out_dir={out_dir}",
        "cell=" + ",".join(map(str, todo)),
        "plot=false",
    ]
    # its own session: Ctrl-C reaches it once, from here, and it stops its jobs
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        console.print(f"[yellow]stopping the launcher's jobs (up to {FARM_GRACE_S:.0f} s)[/]")
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=FARM_GRACE_S)
        except subprocess.TimeoutExpired:
            stop_groups([proc], grace_s=10)
        raise
