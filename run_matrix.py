"""`python run_matrix.py [workload=...] [grid.AXIS=[...]] [overrides=[...]]`: sweep a hardware grid.

Runs every cell of the grid (`conf/matrix.yaml`) as its own isolated process tree (see
`labtools/matrix.py`), appends each cell's result as it comes, then draws one heatmap per metric
with seaborn. The last line is `cells ok: N of M`.

Past one machine, name a Hydra launcher plugin and the cells not yet done go to it, one job a
cell, each still its own process tree with its memory cap, appending to the same results table
(a folder every node sees); when they are back, this run draws the heatmaps:
    python run_matrix.py hydra/launcher=ray hydra.launcher.ray.init.address=HEAD:6379
Interrupted, the same command goes on with the cells not yet done (docs/run_matrix.md).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from lab import commandline
from lab.cli import EXIT_INTERRUPTED, reported
from lab.config import to_settings
from labtools import matrix
from labtools.sweep import farm, sweep

log = logging.getLogger("run_matrix")


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def launcher_named() -> str | None:
    """The Hydra launcher plugin a plain run names (`hydra/launcher=ray`): the cells go to it.
    None when the run names none, or is itself one of a launcher's jobs (`--multirun`)."""
    hydra_config = HydraConfig.get()
    if hydra_config.mode != RunMode.RUN:
        return None
    target = str(hydra_config.launcher.get("_target_", ""))
    return None if target in ("", BASIC_LAUNCHER) else target


LAUNCHER_PLUGINS = {
    "ray": ("hydra_plugins.hydra_ray_launcher", "the Ray extra: `make ray-deps`"),
    "submitit": ("hydra_plugins.hydra_submitit_launcher", "pip install hydra-submitit-launcher"),
}
"""A launcher plugin's module and how to install it, by the start of its `hydra/launcher` name."""


def launcher_missing(argv: list[str]) -> str | None:
    """One line when `hydra/launcher=NAME` names a plugin that is not installed (Hydra's own
    answer lists the options and its advice), else None."""
    for arg in argv:
        if arg.startswith("hydra/launcher="):
            name = arg.split("=", 1)[1]
            for prefix, (module, install) in LAUNCHER_PLUGINS.items():
                if name.startswith(prefix) and not _importable(module):
                    return f"{arg} needs {install}"
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing too
        return False


@hydra.main(version_base="1.3", config_path="conf", config_name="matrix")
def main(cfg: DictConfig) -> None:
    with reported():  # a bad setting: one line, exit 2
        config = to_settings(cfg, matrix.MatrixConfig)
    kept = (f"interrupted; the cells done are kept in {config.out_dir}: the same command goes "
            "on with the others")  # fmt: skip
    with reported(interrupted=kept):
        launcher = launcher_named() if config.cell < 0 else None
        if launcher is not None:
            console = Console()
            script, job = Path(__file__).resolve(), HydraConfig.get()
            status = farm(config, launcher, console, script=script, hydra_config=job)
            records = sweep(config, console=console, run=False)
            missing = len(matrix.cells(config)) - len(records)
            if status != 0 or missing:
                console.print(
                    f"[yellow]the launcher exited {status}; {missing} cells have no record: "
                    "the same command sends them again[/]"
                )
        else:
            records = sweep(config)
        if config.cell >= 0:  # one job of a launcher: its own cell's line
            records = [r for r in records if r["index"] == config.cell]
        ok = sum(r["status"] == "ok" for r in records)
        total = len(matrix.cells(config)) if config.cell < 0 else 1
        print(f"cells ok: {ok} of {total}")


if __name__ == "__main__":
    # a mistaken override, a flag that is not Hydra's: one line, exit 2, before Hydra runs
    commandline.refuse_or_exit("matrix", matrix.MatrixConfig, sys.argv[1:],
                               command="python run_matrix.py")  # fmt: skip
    missing = launcher_missing(sys.argv[1:])
    if missing:
        print(f"run_matrix: {missing}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    except KeyboardInterrupt:  # a launcher's driver (`farm`'s child) stopped: one line
        print("run_matrix: the launcher's jobs were stopped", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
