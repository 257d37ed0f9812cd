"""Networked runs side by side without port clashes, and `labtools.report` over their folders."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab.plots import legend_check
from labtools import report

QUICK = ["spec.num_prompts=1", "spec.max_new_tokens=8", "spec.prompt_tokens=16",
         "target.lab_preset=debug", "draft.lab_preset=debug", "tracking.wandb=false"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, lab_cache: Path) -> list[Path]:
    """A Hydra multirun of 2 spec_decoding jobs, with a third run started beside it."""
    root = tmp_path_factory.mktemp("runs")
    common = [*QUICK, f"paths.cache_dir={lab_cache}"]
    subprocess.run([sys.executable, "-m", "lab.pretrain", "pretrain=debug",
                    f"paths.cache_dir={lab_cache}", f"hydra.run.dir={root / 'pretrain'}"],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    multirun = subprocess.Popen(
        [sys.executable, "-m", "spec_decoding", "--multirun", "seed=0,1", *common,
         f"hydra.sweep.dir={root / 'multirun'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    beside = subprocess.run(
        [sys.executable, "-m", "spec_decoding", *common, f"hydra.run.dir={root / 'beside'}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output, _ = multirun.communicate(timeout=600)
    assert beside.returncode == 0, beside.stderr[-3000:]
    assert multirun.returncode == 0, output[-3000:]
    (root / "multirun" / "output.txt").write_text(output)
    return [root / "multirun" / "0", root / "multirun" / "1", root / "beside"]


def test_a_multirun_names_each_jobs_values_and_ends_with_one_summary(runs: list[Path]) -> None:
    """Each job's final table names the values it ran with; at the end one table of every job
    by its swept values, with its metrics, also as summary.csv in the sweep's folder."""
    import csv

    sweep = runs[0].parent
    output = (sweep / "output.txt").read_text()
    for seed in (0, 1):
        assert re.search(rf"spec_decoding: final metrics \(seed={seed}\)", output), output[-3000:]
    assert "spec_decoding: 2 jobs" in output and f"summary: {sweep / 'summary.csv'}" in output
    rows = list(csv.reader((sweep / "summary.csv").open()))
    assert rows[0][:2] == ["seed", "speedup"]  # only the swept key, then the headline figure
    assert [row[0] for row in rows[1:]] == ["0", "1"]
    assert all(float(value) > 0 for value in rows[1][1:] if value)
    assert (sweep / "summary.md").read_text().startswith("| seed |")


def test_a_multirun_beside_another_run_completes_on_ports_of_its_own(runs: list[Path]) -> None:
    ports = []
    for run_dir in runs:
        text = (run_dir / "verifier_config.yaml").read_text()
        ports.append(int(re.search(r"verifier:\n\s+host: \S+\n\s+port: (\d+)", text)[1]))  # type: ignore[index]
        assert (run_dir / "spec_prompts.png").stat().st_size > 5000  # its own plot
        assert legend_check(run_dir / "spec_prompts.png") == "none"
    assert len(set(ports)) == 3 and 0 not in ports


def test_the_report_shows_every_run_with_its_metrics_plots_and_command(
    runs: list[Path], tmp_path: Path
) -> None:
    page = report.write_report(runs, tmp_path / "report")
    text = page.read_text()
    assert text.count("<section>") == 3
    assert "python -m spec_decoding" in text and "acceptance_rate" in text
    images = re.findall(r"<img src='([^']+)'", text)
    assert len(images) == 3
    for image in images:
        assert (page.parent / image).stat().st_size > 5000
    markdown = (page.parent / "index.md").read_text()
    assert markdown.count("## spec_decoding") == 3 and "| tokens_per_s |" in markdown


def test_the_report_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "labtools.report", str(tmp_path), "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "is neither an experiment's run directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_report_opens_in_a_real_browser_with_every_image_loaded(
    runs: list[Path], tmp_path: Path
) -> None:
    """Headless Chromium (Debian's `chromium`) loads the page: images decode, tables have rows."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (apt install chromium)")
    page = report.write_report(runs, tmp_path / "report")
    probe = page.parent / "probe.html"
    probe.write_text(
        page.read_text().replace(
            "</body>",
            """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  document.body.dataset.images = imgs.length;
  document.body.dataset.broken = imgs.filter(i => !i.complete || i.naturalWidth === 0).length;
  document.body.dataset.empty = [...document.querySelectorAll('table')]
    .filter(t => t.tBodies[0].rows.length === 0).length;
});</script></body>""",
        )
    )
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
         "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    found = re.search(r'data-images="(\d+)" data-broken="(\d+)" data-empty="(\d+)"', dom)
    assert found, dom[:2000]
    assert found.groups() == ("3", "0", "0")
