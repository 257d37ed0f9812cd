"""`python -m labtools.tour` (`make run`): every experiment on the offline defaults, then a report.

Builds the tiny models (once), runs every registered experiment (its manifest's tour step) and
a small run_matrix sweep, each exactly as the command it prints, into `reports/<timestamp>/runs/`,
and writes `reports/<timestamp>/index.html` and `index.md` with every headline metric and plot.
Each step's output goes to `<its run folder>.log`; a failed step quotes its log and the tour goes
on with the next.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from lab import registry
from labtools.report import write_report

PREFACE = (
    "The tour (`make run`) runs each experiment once, briefly, on the lab's tiny models, one "
    "after another on this machine: figures that show each part works and what it reports, "
    "not benchmarks. The summary sets each beside the benchmark figure the docs give, with the "
    "command that measures it."
)

MATRIX_STEP = (
    "matrix",
    ["run_matrix.py", "grid.context=[128,512]", "grid.batch=[1,4]", "repeats=2"],
)


def steps() -> list[tuple[str, list[str]]]:
    """Each step: its run folder's name and its command (after `python`): every registered
    experiment with a tour step (its manifest's `tour` overrides), then a small sweep."""
    return [
        *((name, ["-m", name, *m.tour]) for name, m in registry.manifests().items()
          if m.tour is not None),
        MATRIX_STEP,
    ]  # fmt: skip


def run_step(argv: list[str], *, log_path: Path, progress: Progress, task: TaskID) -> int:
    """Run one command, its output into `log_path`, its last line shown beside the bar."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.strip():
                progress.update(task, last=line.strip()[:70])
        return proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m labtools.tour", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="default: reports/<timestamp>")
    parser.add_argument("--only", nargs="*", default=None, help="run only these steps")
    args = parser.parse_args(argv)
    out = args.out or Path("reports") / time.strftime("%Y-%m-%d_%H-%M-%S")
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    console = Console()
    chosen = [s for s in steps() if args.only is None or s[0] in args.only]
    plan = [("pretrain", ["-m", "lab.pretrain"]), *chosen]
    done: list[Path] = []
    failed: list[str] = []
    progress = Progress(
        TextColumn("[bold]tour"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[step]}"),
        TimeElapsedColumn(),
        TextColumn("[dim]{task.fields[last]}"),
        console=console,
    )
    started = time.monotonic()
    with progress:
        task = progress.add_task("tour", total=len(plan), step="", last="")
        for name, command in plan:
            run_dir = runs / name
            where = f"out_dir={run_dir}" if name == "matrix" else f"hydra.run.dir={run_dir}"
            argv_step = [sys.executable, *command, where]
            shown = shlex.join(["python", *command, where])  # as a shell takes it
            progress.update(task, step=name, last="")
            progress.console.print(f"[bold]{name}[/]: {shown}", soft_wrap=True)
            step_started = time.monotonic()
            code = run_step(argv_step, log_path=runs / f"{name}.log", progress=progress, task=task)
            seconds = time.monotonic() - step_started
            if code == 0:
                progress.console.print(f"  done in {seconds:.0f}s")
                if name != "pretrain":
                    done.append(run_dir)
            else:
                failed.append(name)
                tail = deque((runs / f"{name}.log").read_text().splitlines(), maxlen=12)
                progress.console.print(f"[red]  {name} failed (exit {code}):[/]")
                for line in tail:
                    progress.console.print(
                        f"    {line}", markup=False, highlight=False, soft_wrap=True
                    )
            progress.advance(task)
    page = write_report(done, out, preface=PREFACE) if done else None
    minutes = (time.monotonic() - started) / 60
    if page is not None:
        console.print(f"report: {page.resolve()}  (and index.md beside it)", soft_wrap=True)
    console.print(
        f"tour: {len(plan) - len(failed)} of {len(plan)} steps ok in {minutes:.1f} min"
        + (f"; failed: {', '.join(failed)} (logs in {runs})" if failed else "")
    )
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
