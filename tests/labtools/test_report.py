"""Networked runs side by side without port clashes, and `labtools.report` over their folders."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lab.plots import legend_check
from labtools import report
from tests.clocks import HANG_GUARD_S

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
    for row in rows[1:]:  # every cell a finite number; what must be positive is
        values = {key: float(value) for key, value in zip(rows[0], row, strict=True) if value}
        assert all(math.isfinite(value) for value in values.values()), row
        assert values["speedup"] > 0 and values["tokens_per_s"] > 0, values
        assert 0 <= values["acceptance_rate"] <= 1, values  # a debug draft may accept none
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


def test_the_report_of_a_multirun_folder_opens_with_a_summary_and_names_jobs_by_their_values(
    runs: list[Path], tmp_path: Path
) -> None:
    """`python -m labtools.report multirun/...`: the summary first (each run's headline figure
    with its unit, what it means, the docs' benchmark figure beside it, and why they may
    differ), the sweep's table, then each job titled by its swept values; numbers in a fixed
    precision with their units, never in exponent form."""
    sweep = runs[0].parent
    result = subprocess.run(
        [sys.executable, "-m", "labtools.report", str(sweep), "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    markdown = (tmp_path / "r" / "index.md").read_text()
    titles = re.findall(r"^## (.+)$", markdown, flags=re.M)
    assert titles == ["Summary", "multirun: multirun (2 jobs)", "spec_decoding (seed=0)",
                      "spec_decoding (seed=1)"], titles  # fmt: skip
    summary = markdown.split("## multirun")[0]
    rows = [line for line in summary.splitlines() if line.startswith("| spec_decoding (seed=")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "speedup over the target alone"
        assert re.fullmatch(r"\d+\.\d\dx", cells[2]), cells[2]
        assert "target.lab_preset=debug" in cells[3]  # why it may differ: its settings
    assert summary.count("bench/spec_decoding_bench.py") == 1  # the benchmark, once
    assert "| tokens_per_s | " in markdown and " | tokens/s |" in markdown
    assert not re.search(r"\d\.\d+e[+-]\d\d", markdown.split("## spec_decoding (seed=0)")[1])
    html_text = (tmp_path / "r" / "index.html").read_text()
    assert html_text.index("<h2>Summary</h2>") < html_text.index("<h2>spec_decoding (seed=0)")


def test_the_report_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "labtools.report", str(tmp_path), "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert result.returncode == 2
    assert "is neither an experiment's run directory" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_refused_folder_points_at_the_runs_further_down(runs: list[Path], tmp_path: Path) -> None:
    deep = tmp_path / "a" / "b" / "c"
    shutil.copytree(runs[2], deep / "beside")
    with pytest.raises(ValueError, match=r"runs further down: .*a/b/c/beside"):
        report.discover(tmp_path)


def test_metrics_read_in_fixed_precision_with_their_units() -> None:
    from lab.tables import fixed, unit_of

    assert [unit_of(k) for k in ("token_ms_p50", "tokens_per_s", "bytes_up_per_round",
            "final_val_loss", "acceptance_rate", "latency_ratio", "stage1_peak_rss_mib",
            "round_s", "rounds")] == ["ms", "tokens/s", "B", "nats/token", "fraction", "x",
                                      "MiB", "s", ""]  # fmt: skip
    assert fixed(952600.0, "B") == "952,600"
    assert fixed(3.123456, "nats/token") == "3.1235"
    assert fixed(0.71234, "fraction") == "0.712"
    assert fixed(1.2345, "x") == "1.23"
    assert fixed(1234.5678, "ms") == "1,235"
    assert fixed(16.123, "ms") == "16.12"
    assert fixed(3, "") == "3"


@pytest.mark.slow
def test_the_report_opens_in_a_real_browser_summary_first_images_loaded_and_compact(
    runs: list[Path], tmp_path: Path
) -> None:
    """Headless Chromium (Debian's `chromium`; `make browser-deps`) loads the page: the summary
    is the first section, images decode, tables have rows, the page is no wider than the window
    and about a screen per run, and a screenshot of it is written."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (make browser-deps, or apt install chromium)")
    page = report.write_report(runs, tmp_path / "report")
    for image in (page.parent / "images").glob("*.png"):
        assert legend_check(image) == "none", image  # the copies keep the plots' own check
    probe = page.parent / "probe.html"
    probe.write_text(
        page.read_text().replace(
            "</body>",
            """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const d = document.body.dataset, root = document.documentElement;
  d.images = imgs.length;
  d.broken = imgs.filter(i => !i.complete || i.naturalWidth === 0).length;
  d.empty = [...document.querySelectorAll('table')]
    .filter(t => t.tBodies[0].rows.length === 0).length;
  d.first = document.querySelector('h2').textContent;
  d.height = root.scrollHeight;
  d.wide = root.scrollWidth > root.clientWidth ? 1 : 0;
  // legible: no plot shrunk below report.LEGIBLE_SCALE of its own pixels
  d.small = imgs.filter(i => i.clientWidth < 0.65 * i.naturalWidth)
    .map(i => i.alt + ':' + i.clientWidth + '/' + i.naturalWidth).join(' ');
});</script></body>""",
        )
    )
    window = ["--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000",
              "--allow-file-access-from-files"]  # fmt: skip
    dom = subprocess.run(
        [browser, *window, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    ).stdout  # fmt: skip
    found = re.search(
        r'data-images="(\d+)" data-broken="(\d+)" data-empty="(\d+)" data-first="([^"]*)" '
        r'data-height="(\d+)" data-wide="(\d)" data-small="([^"]*)"', dom
    )  # fmt: skip
    assert found, dom[:2000]
    images, broken, empty, first, height, wide, small = found.groups()
    assert (images, broken, empty, first, wide) == ("3", "0", "0", "Summary", "0")
    assert report.LEGIBLE_SCALE == 0.65 and small == "", small  # every plot legible
    assert int(height) < 1400 * (len(runs) + 1), height  # it was 8,460 px for the tour's six
    shot = tmp_path / "report.png"
    subprocess.run(
        [browser, *window, "--hide-scrollbars", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=HANG_GUARD_S,
        check=True,
    )
    assert shot.stat().st_size > 20_000


def test_a_plot_too_wide_to_read_at_half_the_page_takes_a_row_of_its_own(tmp_path: Path) -> None:
    """data_parallel's two panels (10 inches, 1,100 px) shown half a row wide were shrunk to
    about half: their text was 8 px. A plot that would shrink below report.LEGIBLE_SCALE
    spans the row; one that stays legible sits beside another."""
    from PIL import Image

    out = tmp_path / "report"
    (out / "images").mkdir(parents=True)
    wide, narrow = Path("images/wide.png"), Path("images/narrow.png")
    Image.new("RGB", (1100, 385)).save(out / wide)
    Image.new("RGB", (660, 385)).save(out / narrow)
    section = report.Section("dp", "python -m data_parallel", "", [("a", "1", "")],
                             ("metric", "value", "unit"), images=[wide, narrow])  # fmt: skip
    full = report._full_row([section], out)
    assert full == {wide}
    page = report._html([section], "now", full_row=full)
    assert "<img src='images/wide.png' alt='wide' class='full'>" in page
    assert "<img src='images/narrow.png' alt='narrow'>" in page
    assert 660 * report.LEGIBLE_SCALE <= report.HALF_ROW_PX < 1100 * report.LEGIBLE_SCALE


def test_the_summary_shows_the_figure_the_runs_own_table_printed(tmp_path: Path) -> None:
    """One figure, one value: the headline read again from the steps (their median, 84.32 ms)
    differed from the run's own final table (82.00 ms); the summary now shows the table's."""
    import json

    steps = [{"kind": "metrics", "step": s, "step_ms": ms, "loss": 4.0}
             for s, ms in enumerate((120.0, 84.32, 84.32, 80.0), start=1)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    head = report.headline_of(tmp_path, {"job": "data_parallel"}, {"step_ms": 82.0})
    assert head is not None and head.value.startswith("82.00 ms"), head
    head = report.headline_of(tmp_path, {"job": "data_parallel"}, {})  # no table: the steps'
    assert head is not None and head.value.startswith("84.32 ms"), head
