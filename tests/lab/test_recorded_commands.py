"""A command the lab records (a run's lab_run.json, run_matrix's sweep.json, hence the report's
`Command:` lines) is pasted back into a shell as written and does what ran: `+` and `~`
overrides, brackets, quotes and spaces survive (issue 50: the sweep's command dropped them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lab.config import CONF_DIR, TrackingConfig, to_settings
from lab.tracking import RUN_FILE, Tracker
from labtools import matrix, sweep
from tests.clocks import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def pasted(command: str, *, prelude: str = "", extra: str = "") -> subprocess.CompletedProcess:
    """`command` through `bash -c` as a user pastes it, `python` being this interpreter."""
    script = f'python() {{ "{sys.executable}" "$@"; }}\n{prelude}\n{command} {extra}'
    return subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


def test_a_runs_recorded_command_gives_back_every_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = ["+grid.window=[1,4]", "~grid.batch", 'overrides=["a=b c","d=it\'s"]',
             f"hydra.run.dir={tmp_path / 'a run'}", "spec.gamma=*", "x=$HOME"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", [str(ROOT / "spec_decoding" / "__main__.py"), *words])
    with Tracker(tmp_path, config={}, tracking=TrackingConfig(wandb=False), job="spec_decoding"):
        pass
    command = json.loads((tmp_path / RUN_FILE).read_text())["command"]
    assert command.startswith("python -m spec_decoding ")
    # the shell hands `python` exactly the words the run was given
    result = pasted(command, prelude='python() { printf "%s\\0" "$@"; }')
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\0")[:-1] == ["-m", "spec_decoding", *words]


def test_a_sweeps_recorded_command_composes_the_same_sweep(tmp_path: Path) -> None:
    """`+grid.X` for an axis conf/matrix.yaml lacks, `~grid.X` for one the sweep dropped, the
    overrides quoted: Hydra, given the pasted command, composes the sweep that ran."""
    overrides = [
        "workload=spec_decoding", "~grid.context", "~grid.batch", "+axes.depth=spec.branch_depth",
        "+grid.depth=[0,2]", "+grid.window=[1,4]",
        'overrides=["target.lab_preset=debug","draft.lab_preset=debug","spec.top_p=0.9"]',
        "repeats=1", "plot=false", f"out_dir={tmp_path / 'the sweep'}",
    ]  # fmt: skip
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="matrix", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
    config = to_settings(cfg, matrix.MatrixConfig)
    command = sweep.command_of(config)
    assert "~grid.batch" in command and "'+grid.depth=[0,2]'" in command
    result = pasted(command, extra="--cfg job")
    assert result.returncode == 0, result.stderr[-2000:]
    again = yaml.safe_load(result.stdout)
    assert again["workload"] == config.workload
    assert again["grid"] == config.grid and list(again["grid"]) == list(config.grid)
    assert again["axes"] == config.axes
    assert again["overrides"] == config.overrides
    assert again["repeats"] == 1 and again["plot"] is False
    assert again["out_dir"] == config.out_dir


def test_a_sweeps_recorded_command_keeps_its_secret_out_and_still_runs(tmp_path: Path) -> None:
    config = matrix.MatrixConfig(
        workload="fed_learn",
        axes={"clients": "fed.num_clients"},
        grid={"clients": [2]},
        overrides=['cluster.secret=it\'s "mine"', "model.lab_preset=debug"],
        out_dir=str(tmp_path / "sweep"),
    )
    command = sweep.command_of(config)
    assert "mine" not in command and "cluster.secret=***" in command
    result = pasted(command, extra="--cfg job")
    assert result.returncode == 0, result.stderr[-2000:]
    again = yaml.safe_load(result.stdout)
    assert again["overrides"] == ["cluster.secret=***", "model.lab_preset=debug"]
    assert "context" not in again["grid"] and again["grid"]["clients"] == [2]
