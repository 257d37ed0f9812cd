"""run_matrix: a real sweep of split_inference, its failure statuses, resuming, and the guards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from lab import registry
from lab.registry import Metric
from labtools import matrix, sweep
from tests.clocks import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, lab_cache: Path, **changes: Any) -> matrix.MatrixConfig:
    """A quick sweep of split_inference on the debug model (trained tiny models, 2 layers)."""
    base: dict[str, Any] = {
        "workload": "split_inference",
        "axes": {"context": "generate.prompt_tokens", "batch": "generate.batch_size",
                 "stages": "split.num_stages", "delay": "cluster.link.delay_ms"},
        "grid": {"context": [8, 16], "batch": [1, 2]},
        "overrides": ["model.lab_preset=debug", f"paths.cache_dir={lab_cache}",
                      "generate.max_new_tokens=4"],
        "repeats": 2,
        "out_dir": str(tmp_path / "sweep"),
        "timeout_s": 240.0,
    }  # fmt: skip
    base.update(changes)
    return matrix.MatrixConfig(**base)


def _leftovers(out_dir: Path) -> list[str]:
    """Processes still running whose command line names the sweep's folder."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(out_dir) in cmdline:
            found.append(cmdline)
    return found


def test_a_2x1_sweep_gives_2_rows_a_heatmap_per_metric_and_resumes(
    tmp_path: Path, lab_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    # two cells (each a 3-process split run): the grid, heatmaps, W&B and resume, at half the
    # cost of four (make test's budget)
    cfg = config(tmp_path, lab_cache, wandb=True, grid={"context": [8, 16], "batch": [1]})
    records = sweep.sweep(cfg)
    assert [r["status"] for r in records] == ["ok"] * 2, [r["reason"] for r in records]
    out = Path(cfg.out_dir)
    rows = (out / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2
    assert "settings.context" in rows[0] and "metrics.token_ms_p50" in rows[0]
    for record in records:
        metrics = record["metrics"]
        assert metrics["token_ms_p50_n"] == 2  # two measured batches, warm-up excluded
        assert metrics["latency_ratio"] > 0 and metrics["greedy_match"] == 1.0
        assert {"main", "stage1", "stage2"} <= set(record["peak_rss_mib"])
        assert record["machine"]["cores"] >= 1
    heatmaps = sorted(p.stem for p in (out / "heatmaps").glob("*.png"))
    metrics = registry.manifest("split_inference").workload.metrics
    measured = {key for record in records for key in record["metrics"]}  # serve_*: with clients
    assert heatmaps == sorted(m.key for m in metrics if m.key in measured)
    assert all(p.stat().st_size > 5000 for p in (out / "heatmaps").glob("*.png"))
    # one offline W&B run for the sweep: every heatmap as an image, the results as a table
    (wandb_run,) = (out / "wandb").glob("offline-run-*")
    media = wandb_run / "files" / "media"
    images = (media / "images" / "heatmap").glob("*.png")
    logged = sorted(re.sub(r"_\d+_[0-9a-f]+$", "", p.stem) for p in images)  # W&B adds step, hash
    assert logged == heatmaps
    (table,) = (media / "table").glob("results_*.table.json")
    assert len(json.loads(table.read_text())["data"]) == 2
    # the same sweep again: nothing re-runs; a wider grid runs only its new cells
    before = (out / "results.jsonl").read_text()
    assert sweep.sweep(cfg) == records
    assert (out / "results.jsonl").read_text() == before
    wider = config(tmp_path, lab_cache, grid={"context": [8], "batch": [1, 2]})
    assert [r["settings"]["batch"] for r in sweep.sweep(wider)] == [1, 2]
    assert len((out / "results.jsonl").read_text().splitlines()) == 2 + 1
    assert not _leftovers(out)


def test_a_failing_cell_is_marked_with_its_reason_and_the_sweep_goes_on(
    tmp_path: Path, lab_cache: Path
) -> None:
    """3 stages of a 2-layer model: refused by the experiment before it starts anything."""
    cfg = config(tmp_path, lab_cache, grid={"stages": [3, 2]}, overrides=[
        "model.lab_preset=debug", f"paths.cache_dir={lab_cache}", "generate.max_new_tokens=2",
        "generate.prompt_tokens=8"])  # fmt: skip
    failed, ok = sweep.sweep(cfg)
    assert failed["status"] == "error"
    assert "split.num_stages=3 needs at least as many layers" in failed["reason"]
    assert ok["status"] == "ok"


@pytest.mark.parametrize(
    ("changes", "status", "reason"),
    [
        pytest.param(
            {"timeout_s": 6.0}, "timeout", "still running after 6s", marks=pytest.mark.slow
        ),  # make test's budget: the oom case kills alike
        ({"memory_mib": 150.0}, "oom", "MiB > the 150 MiB cap"),
    ],
)
def test_a_cell_past_its_time_or_memory_is_killed_whole_and_marked(
    tmp_path: Path, lab_cache: Path, changes: dict, status: str, reason: str
) -> None:
    cfg = config(tmp_path, lab_cache, grid={"context": [8]}, **changes)
    (record,) = sweep.sweep(cfg)
    assert record["status"] == status and reason in record["reason"]
    assert not _leftovers(Path(cfg.out_dir))  # stage processes too, though in other sessions
    # a failed cell is kept as failed on a re-run, and retried when asked
    assert sweep.sweep(cfg)[0]["time"] == record["time"]
    retried = config(tmp_path, lab_cache, grid={"context": [8]}, retry_failed=True, **changes)
    assert sweep.sweep(retried)[0]["time"] > record["time"]


def test_a_key_the_workload_does_not_read_is_refused_before_any_cell_runs(
    tmp_path: Path, lab_cache: Path
) -> None:
    cfg = config(tmp_path, lab_cache, grid={"delay": [0, 10]})
    with pytest.raises(ValueError, match=r"split_inference does not read cluster\.link\.delay_ms"):
        sweep.sweep(cfg)
    assert not (Path(cfg.out_dir) / "results.jsonl").exists()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"grid": {"depth": [1]}}, "grid.depth: no such axis"),
        ({"grid": {}}, "grid is empty"),
        ({"workload": "pretrain"}, "workload='pretrain' is not one run_matrix can sweep"),
        ({"repeats": 0}, "matrix.repeats=0 must be > 0"),
    ],
)
def test_a_bad_sweep_is_refused_naming_the_key(
    tmp_path: Path, lab_cache: Path, changes: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        config(tmp_path, lab_cache, **changes)


def test_a_cell_summary_keeps_the_median_and_spread_of_its_repeats(tmp_path: Path) -> None:
    lines = [
        {"kind": "metrics", "step": 0, "token_ms_p50": 10.0},
        {"kind": "metrics", "step": 1, "token_ms_p50": 30.0},
        {"kind": "metrics", "step": 2, "token_ms_p50": 20.0},
        {"kind": "summary", "token_ms_p50": 99.0, "stage1_peak_rss_mib": 5.0,
         "stage2_peak_rss_mib": 7.0, "latency_ratio": 2.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    metrics = matrix.summarize_cell(tmp_path)
    assert metrics["token_ms_p50"] == 20.0 and metrics["token_ms_p50_spread"] == 1.0
    assert metrics["token_ms_p50_n"] == 3 and metrics["latency_ratio"] == 2.0
    assert metrics["max_stage_peak_rss_mib"] == 7.0


def test_a_key_the_experiment_does_not_have_is_refused_before_any_cell_runs(
    tmp_path: Path, lab_cache: Path
) -> None:
    cfg = config(tmp_path, lab_cache, axes={"depth": "split.depth"}, grid={"depth": [1, 2]})
    with pytest.raises(ValueError, match=r"does not compose: .*split\.depth"):
        sweep.sweep(cfg)
    assert not (Path(cfg.out_dir) / "results.jsonl").exists()


def test_a_cells_processes_are_reported_by_role_never_by_pid(tmp_path: Path) -> None:
    """A process without `role=` (torch's elastic workers, a helper) is named after its
    nearest named ancestor and its rank or place: the CSV's columns are the same in every
    cell, not `peak_rss_mib.pid25390`."""
    script = (
        "import os, subprocess, sys\n"
        "nap = [sys.executable, '-c', 'import time; time.sleep(2)']\n"
        "kids = [subprocess.Popen([*nap, 'role=stage', 'split.rank=1']),\n"
        "        subprocess.Popen(nap, env={**os.environ, 'LOCAL_RANK': '1'}),\n"
        "        subprocess.Popen(nap)]\n"
        "[k.wait() for k in kids]\n"
    )
    outcome = matrix.run_cell_process([sys.executable, "-c", script], cwd=tmp_path,
                                      log_path=tmp_path / "cell.log", timeout_s=60,
                                      memory_mib=10_000)  # fmt: skip
    assert outcome.status == "ok", (tmp_path / "cell.log").read_text()
    assert set(outcome.peak_rss_mib) == {"main", "stage1", "main.rank1", "main.sub1"}


def test_a_ratio_heatmap_is_centred_on_1_symmetric_in_log_and_spans_at_least_2x() -> None:
    """0.5x and 2x are equally far from white; a 10% difference is a tint, not the palette's
    ends; a sweep with 0.12x in it reaches 1/0.12 on the other side."""
    from labtools.heatmaps import colour_scale, footnote

    ratio = Metric("memory_ratio", "peak RSS ratio", "x", ratio=True)
    pale = colour_scale(ratio, [0.90, 1.12])
    assert pale["center"] == 1.0 and pale["cmap"] == "RdBu_r"
    assert pale["vmin"] == pytest.approx(0.5) and pale["vmax"] == pytest.approx(2.0)
    wide = colour_scale(ratio, [0.12, 0.83, 1.5])
    assert wide["vmin"] == pytest.approx(0.12) and wide["vmax"] == pytest.approx(1 / 0.12)
    assert colour_scale(Metric("step_ms", "step", "ms"), [1.0, 9.0]) == {"cmap": "viridis"}
    assert footnote(spread=False, failed=False) == ""
    assert "±" in footnote(spread=True, failed=False)
    assert "±" not in footnote(spread=False, failed=True)
    assert "grey" in footnote(spread=False, failed=True)


def _cell_record(cfg: matrix.MatrixConfig, cell: matrix.Cell, baseline: float) -> dict[str, Any]:
    return {"sweep": matrix.sweep_fingerprint(cfg), "workload": cfg.workload, "cell": cell.name,
            "index": cell.index, "settings": dict(cell.values), "status": "ok", "reason": "",
            "seconds": 1.0, "metrics": {"unsplit_token_ms_p50": baseline, "latency_ratio": 1.2},
            "peak_rss_mib": {}, "peak_total_rss_mib": 0.0, "repeats": 2, "run_dir": "",
            "command": [], "machine": {}, "time": 0.0}  # fmt: skip


def test_a_cell_whose_baseline_is_off_its_groups_is_flagged_in_its_line_and_its_row(
    tmp_path: Path, lab_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three cells that differ only in split.wire_dtype measure the same unsplit model: one
    whose unsplit latency is 3x the others' was measured on a busy machine. The sweep says so
    (its table: `ok, busy?`); retry_flagged=true runs that cell again (the slow test below)."""
    cfg = config(tmp_path, lab_cache, grid={"wire": ["float32", "float16", "bfloat16"]},
                 axes={"wire": "split.wire_dtype"}, plot=False)  # fmt: skip
    cells = matrix.cells(cfg)
    results = matrix.Results(Path(cfg.out_dir))
    for cell, baseline in zip(cells, (5.0, 15.0, 5.2), strict=True):
        results.append(_cell_record(cfg, cell, baseline))
    sweep.sweep(cfg)  # nothing to run: every cell is recorded
    output = capsys.readouterr().out
    assert (
        f"flagged {cells[1].name}: baseline unsplit_token_ms_p50 15 against a median of 5.2"
        in output
    )
    assert output.count("ok, busy?") == 1, output  # its row in the table, the others ok


@pytest.mark.slow  # one real cell: make test's budget
def test_retry_flagged_runs_the_flagged_cell_again_and_only_it(
    tmp_path: Path, lab_cache: Path
) -> None:
    cfg = config(tmp_path, lab_cache, grid={"wire": ["float32", "float16", "bfloat16"]},
                 axes={"wire": "split.wire_dtype"}, plot=False, retry_flagged=True)  # fmt: skip
    cells = matrix.cells(cfg)
    results = matrix.Results(Path(cfg.out_dir))
    for cell, baseline in zip(cells, (5.0, 15.0, 5.2), strict=True):
        results.append(_cell_record(cfg, cell, baseline))
    sweep.sweep(cfg)
    records = results.records()
    assert [r["cell"] for r in records[3:]] == [cells[1].name]  # that cell alone, for real
    assert records[3]["status"] == "ok" and records[3]["metrics"]["greedy_match"] == 1.0


def test_busy_baselines_compares_only_cells_that_should_measure_the_same() -> None:
    workload = registry.manifest("spec_decoding").workload
    axes = {"window": "spec.gamma", "context": "spec.prompt_tokens"}

    def record(cell: str, window: int, context: int, baseline: float) -> dict[str, Any]:
        return {"cell": cell, "status": "ok", "settings": {"window": window, "context": context},
                "metrics": {"target_tokens_per_s": baseline}}  # fmt: skip

    sweep = [record("a", 2, 64, 1050), record("b", 4, 64, 1154), record("c", 8, 64, 376),
             record("d", 16, 64, 1100), record("e", 2, 512, 300),
             record("f", 4, 512, 310)]  # fmt: skip
    flags = matrix.busy_baselines(sweep, workload, axes, 0.25)
    assert list(flags) == ["c"]  # e and f measure a longer context: their own group of two
    assert "376 against a median of 1,075" in flags["c"]
    assert matrix.busy_baselines(sweep, workload, axes, 0.8) == {}
    assert matrix.busy_baselines(sweep[:2] + sweep[4:], workload, axes, 0.25) == {}  # < 3 alike
    fed = registry.manifest("fed_learn").workload  # no baseline: nothing to flag
    assert matrix.busy_baselines(sweep, fed, axes, 0.25) == {}
    assert matrix.unsteady_baselines(sweep, workload, axes, 0.25) == []  # c stood out alone


def test_a_sweep_whose_every_baseline_moved_flags_no_cell_but_says_the_machine_moved() -> None:
    """A 2x2 sweep on a busy machine: every cell's baseline is off the median of the four, so
    none is the busy one; the report says the machine's speed moved instead."""
    workload = registry.manifest("spec_decoding").workload
    axes = {"window": "spec.gamma", "temperature": "spec.temperature"}

    def record(cell: str, window: int, baseline: float) -> dict[str, Any]:
        return {"cell": cell, "status": "ok", "settings": {"window": window, "temperature": 0},
                "metrics": {"target_tokens_per_s": baseline}}  # fmt: skip

    sweep = [record("a", 2, 500), record("b", 4, 800), record("c", 8, 1300), record("d", 16, 2000)]
    assert matrix.busy_baselines(sweep, workload, axes, 0.25) == {}
    (remark,) = matrix.unsteady_baselines(sweep, workload, axes, 0.25)
    assert "ranges 500 to 2,000 over a, b, c, d" in remark and "2 of 4" in remark


def test_a_piped_table_keeps_its_headers_whole() -> None:
    """Piped or logged, rich would cut a table to 80 columns and `tokens_per_s (tokens/s)` to
    `tokens_p…`; print_wide prints it at its own width."""
    import io

    from rich.console import Console
    from rich.table import Table

    from lab.tables import print_wide

    table = Table()
    for name in ("context", "batch", "status", "tokens_per_s (tokens/s)",
                 "target_tokens_per_s (tokens/s)", "acceptance_rate (fraction)", "speedup (x)",
                 "time (s)"):  # fmt: skip
        table.add_column(name)
    table.add_row("512", "4", "ok", "1,234", "1,100", "0.720", "1.12", "31")
    piped = io.StringIO()
    print_wide(table, Console(file=piped))
    text = piped.getvalue()
    assert "target_tokens_per_s (tokens/s)" in text and "acceptance_rate (fraction)" in text
    assert "…" not in text


def test_an_axis_the_workload_lacks_is_one_line_naming_the_axis(tmp_path: Path) -> None:
    """conf/matrix.yaml's default grid sweeps generate.batch_size; a spec_decoding sweep that
    sets only its own axis is told which axis to drop, in one line, before any cell runs."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "run_matrix.py", "workload=spec_decoding", "grid.context=[16]",
         "axes.context=spec.prompt_tokens", "overrides=[]", f"out_dir={tmp_path / 'sweep'}"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert "~grid.batch drops that axis" in line
    assert not (tmp_path / "sweep" / "cells").exists()


def test_a_cells_processes_end_with_the_process_that_runs_it(tmp_path: Path) -> None:
    """A launcher's worker (Ray, submitit) killed mid-cell, even by SIGKILL, takes the cell with
    it: no cell is left running after Ctrl-C stops a farmed sweep."""
    marker = tmp_path / "cell-marker"
    script = (
        "import sys; from pathlib import Path; from labtools.matrix import run_cell_process; "
        f"run_cell_process([sys.executable, '-c', 'import time; time.sleep(600)', {str(marker)!r}],"
        f" cwd=Path('.'), log_path=Path({str(tmp_path / 'cell.log')!r}), timeout_s=600,"
        " memory_mib=1e9)"
    )
    worker = subprocess.Popen([sys.executable, "-c", script])
    try:
        cell = _wait_for(
            lambda: [p for p in _processes_naming(str(marker)) if p != worker.pid],
            what="the cell to start",
        )
        worker.kill()  # SIGKILL: no cleanup of its own runs
        worker.wait()
        _wait_for(lambda: not psutil.pid_exists(cell[0]) or _zombie(cell[0]),
                  what="the cell to end with its worker")  # fmt: skip
    finally:
        worker.kill()
        for proc in _processes_naming(str(marker)):
            psutil.Process(proc).kill()


def _processes_naming(text: str) -> list[int]:
    return [
        p.pid for p in psutil.process_iter(["cmdline"]) if text in " ".join(p.info["cmdline"] or [])
    ]


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(check: Any, *, what: str, limit_s: float = 120.0) -> Any:
    """Poll `check` until it holds; a generous limit, so only a cell that never ends fails."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what} after {limit_s:.0f} s")
