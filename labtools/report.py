"""`python -m labtools.report RUN_DIR... [--out DIR]`: one report (HTML, Markdown) from run folders.

A run folder is an experiment's run directory (it has `lab_run.json` and `metrics.jsonl`) or a
run_matrix output folder (it has `results.jsonl`). For each: what ran and the command that
reproduces it, the machine, the headline metrics, and its plots (drawn now if the run has none).
Images are copied into the report folder, so it can be moved or shared as it is. A shared secret
a record quotes (`cluster.secret=...`, from a run that predates its redaction) shows as `***`.
"""

from __future__ import annotations

import argparse
import html
import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lab.plots import draw_run
from lab.redact import redact_text
from lab.tables import fixed, unit_of, with_unit
from lab.tracking import METRICS_FILE, RUN_FILE, read_records

SWEEP_FILE = "sweep.json"
"""run_matrix's record of a sweep: its command and configuration."""


@dataclass
class Headline:
    """A run's line in the report's summary: its headline figure beside the docs' benchmark."""

    run: str
    experiment: str
    figure: str
    value: str
    means: str
    benchmark: str
    comparable: str
    """The run's figure that is comparable with the benchmark's, where not the headline."""
    differs: str
    """Why this run's figure may differ from the benchmark's: its settings, its length, the
    machine's load."""


@dataclass
class Section:
    title: str
    command: str
    machine: str
    rows: list[tuple[str, ...]]
    header: tuple[str, ...]
    images: list[Path] = field(default_factory=list)
    note: str = ""
    more: list[tuple[str, ...]] = field(default_factory=list)
    """The rest of the rows, folded away in the HTML (every metric a run reported)."""
    headline: Headline | None = None
    remarks: list[str] = field(default_factory=list)
    """What a reader should not miss (validation loss rising; a sweep cell on a busy machine)."""


def _machine_line(machine: dict[str, Any] | None) -> str:
    if not machine:
        return "not recorded"
    device = machine.get("device_name") or machine.get("device", "")
    load = machine.get("load_1m")
    return (
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{machine.get('memory_gib', '?')} GiB, {machine.get('system', '')}, device {device}; "
        f"torch {machine.get('packages', {}).get('torch', '?')}"
        + (f"; load {load:.2f} when it started" if isinstance(load, int | float) else "")
    )


def _run_overrides(run_dir: Path) -> list[str]:
    """The settings a run was started with, as typed (Hydra's overrides.yaml), less the folder
    and tracking ones that change no figure."""
    for folder in (run_dir, run_dir.parent):
        path = folder / ".hydra" / "overrides.yaml"
        if path.is_file():
            from omegaconf import OmegaConf

            typed = [str(o) for o in OmegaConf.load(path)]
            return [o for o in typed if not o.lstrip("+~").startswith(QUIET_KEYS)]
    return []


QUIET_KEYS = ("hydra.", "paths.", "tracking.", "out_dir", "role=", "cluster.secret")


def headline_of(run_dir: Path, info: dict[str, Any], summary: dict[str, Any]) -> Headline | None:
    """The summary line of an experiment's run: None for a job that is no experiment or a run
    with no figure."""
    from lab import registry

    manifest = registry.find(str(info.get("job", "")))
    if manifest is None:
        return None
    head = manifest.headline
    label, _, unit = head.label.rpartition(" (")
    unit = unit.rstrip(")").split(",")[0].strip()
    try:
        # the figure the run's own final table printed, where it has it: one figure, one value
        # (a headline read again from the steps can differ from the run's own reckoning)
        shown = summary.get(head.key)
        figure = float(shown) if isinstance(shown, int | float) else head.read(run_dir)
        value = with_unit(figure, unit)
    except (OSError, KeyError, ValueError) as exc:
        value = f"not measured ({exc})"
    comparable = ""
    if head.benchmark_key and head.benchmark_key in summary:
        key = head.benchmark_key
        comparable = f"{key} {with_unit(summary[key], unit_of(key))}"
    overrides = _run_overrides(run_dir)
    parts = [
        "this run: " + (", ".join(overrides) if overrides else "the defaults (the tiny models)")
    ]
    machine = info.get("machine") or {}
    load, cores = machine.get("load_1m"), machine.get("cores")
    if isinstance(load, int | float) and isinstance(cores, int) and load >= BUSY_LOAD * cores:
        parts.append(
            f"the machine was loaded as it started (load average {load:.1f} on {cores} cores "
            "over the minute before: other work, or the run before it)"
        )
    return Headline(
        run="",
        experiment=manifest.name,
        figure=label,
        value=value,
        means=head.means,
        benchmark=head.benchmark_text(),
        comparable=comparable,
        differs="; ".join(parts),
    )


BUSY_LOAD = 1.0
"""A load average at or above this share of the cores as a run started: every core was taken."""


def _remarks(records: list[dict[str, Any]]) -> list[str]:
    from lab.plots import rising_validation

    steps = [r for r in records if r.get("kind") == "metrics" and "step" in r]
    validation = [(float(r["step"]), float(r["val_loss"])) for r in steps if "val_loss" in r]
    training = [float(r["loss"]) for r in steps if "loss" in r]
    is_round = any("clients" in r for r in steps)
    remark = rising_validation(validation, training or None, step="round" if is_round else "step")
    return [remark] if remark else []


def experiment_section(run_dir: Path, label: str = "") -> Section:
    """A run's section: its key figures (the headline and the workload's metrics) with units,
    then every other metric, its plots, and remarks."""
    from lab import registry

    info = json.loads((run_dir / RUN_FILE).read_text())
    records = read_records(run_dir / METRICS_FILE)
    summaries = [r for r in records if r.get("kind") == "summary"]
    summary = {k: v for k, v in (summaries[-1] if summaries else {}).items() if k != "kind"}
    images = sorted(run_dir.glob("*.png")) or draw_run(run_dir, info["job"])
    manifest = registry.find(str(info["job"]))
    first = [] if manifest is None else [m.key for m in manifest.workload.metrics]
    if manifest is not None and manifest.headline.benchmark_key:
        first.insert(0, manifest.headline.benchmark_key)
    key_rows: list[tuple[str, ...]] = []
    other_rows: list[tuple[str, ...]] = []
    for key, value in summary.items():
        row = (key, fixed(value, unit_of(key)), unit_of(key))
        (key_rows if key in first else other_rows).append(row)
    key_rows.sort(key=lambda row: first.index(row[0]))
    headline = headline_of(run_dir, info, summary) if summaries else None
    title = f"{info['job']} ({label or run_dir.name})"
    if headline is not None:
        headline.run = title
    return Section(
        title=title,
        command=info.get("command", ""),
        machine=_machine_line(info.get("machine")),
        header=("metric", "value", "unit"),
        rows=key_rows or other_rows,
        more=other_rows if key_rows else [],
        images=images,
        note="" if summaries else "the run has no summary: it did not finish",
        headline=headline,
        remarks=_remarks(records),
    )


def matrix_section(out_dir: Path) -> Section:
    from lab import registry
    from labtools.matrix import MatrixConfig, Results, busy_baselines, unsteady_baselines

    sweep = (
        json.loads((out_dir / SWEEP_FILE).read_text()) if (out_dir / SWEEP_FILE).is_file() else {}
    )
    records = Results(out_dir).records()
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        latest[record["cell"]] = record
    cells = sorted(latest.values(), key=lambda r: r.get("index", 0))
    metric_keys = sweep.get("metrics", [])[:4]
    manifest = registry.find(str(sweep.get("workload", "")))
    units = {m.key: m.unit for m in manifest.workload.metrics} if manifest else {}
    flags: dict[str, str] = {}
    unsteady: list[str] = []
    if manifest is not None:
        tolerance = float(sweep.get("baseline_tolerance", MatrixConfig.baseline_tolerance))
        judged = (cells, manifest.workload, sweep.get("axes", {}), tolerance)
        flags, unsteady = busy_baselines(*judged), unsteady_baselines(*judged)
    rows = []
    for record in cells:
        values = record.get("metrics", {})
        rows.append((
            record["cell"],
            record["status"] + (f": {record['reason']}" if record["status"] != "ok" else "")
            + (", busy?" if record["cell"] in flags else ""),
            *(fixed(values[k], units.get(k, unit_of(k))) if k in values else ""
              for k in metric_keys),
            f"{record.get('seconds', 0):.0f}",
        ))  # fmt: skip
    ok = sum(r["status"] == "ok" for r in cells)
    header = [f"{k} ({units.get(k, unit_of(k))})" if units.get(k, unit_of(k)) else k
              for k in metric_keys]  # fmt: skip
    return Section(
        title=f"run_matrix: {sweep.get('workload', out_dir.name)}",
        command=sweep.get("command", "python run_matrix.py"),
        machine=_machine_line(cells[0].get("machine") if cells else None),
        header=("cell", "status", *header, "time (s)"),
        rows=rows,
        images=sorted((out_dir / "heatmaps").glob("*.png")),
        note=f"cells ok: {ok} of {len(cells)}",
        remarks=[*flags.values(), *unsteady],
    )


MULTIRUN_FILE = "multirun.yaml"
"""What Hydra writes at the top of a multirun's folder, beside the jobs' numbered folders."""


def multirun_jobs(folder: Path) -> list[tuple[Path, str]]:
    """The jobs of the multirun in `folder`, each with its swept values (`seed=1`): the folders
    beside multirun.yaml that hold a run, in job order."""
    from lab.multirun import swept_keys

    jobs = [p for p in folder.iterdir() if p.is_dir() and (p / RUN_FILE).is_file()]
    jobs.sort(key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    settings = [dict(o.lstrip("+~").split("=", 1) for o in _run_overrides(p) if "=" in o)
                for p in jobs]  # fmt: skip
    keys = swept_keys(settings)
    return [
        (job, " ".join(f"{k}={values.get(k, '')}" for k in keys) or job.name)
        for job, values in zip(jobs, settings, strict=True)
    ]


def multirun_section(folder: Path, jobs: list[tuple[Path, str]]) -> Section:
    """One table of the multirun's jobs: its summary.csv (lab.multirun) where it wrote one."""
    from lab.multirun import SUMMARY_CSV

    rows: list[tuple[str, ...]] = []
    header: tuple[str, ...] = ("job", "folder")
    if (folder / SUMMARY_CSV).is_file():
        import csv

        table = list(csv.reader((folder / SUMMARY_CSV).open()))
        typed = {o.lstrip("+~").split("=", 1)[0] for job, _ in jobs for o in _run_overrides(job)}
        swept = sum(1 for name in table[0] if name in typed or name == "job")
        header = tuple(
            name if n < swept or not unit_of(name) else f"{name} ({unit_of(name)})"
            for n, name in enumerate(table[0])
        )
        rows = [
            tuple(cell if n < swept else _refixed(cell, unit_of(table[0][n]))
                  for n, cell in enumerate(row))
            for row in table[1:]
        ]  # fmt: skip
    else:
        rows = [(label, job.name) for job, label in jobs]
    command = f"(Hydra's record: {folder / MULTIRUN_FILE})"
    if jobs:
        command = json.loads((jobs[0][0] / RUN_FILE).read_text()).get("command", command)
    return Section(
        title=f"multirun: {folder.name} ({len(jobs)} jobs)",
        command=command,
        machine="each job's own, below",
        header=header,
        rows=rows,
    )


def _refixed(cell: str, unit: str) -> str:
    try:
        return fixed(float(cell), unit)
    except ValueError:
        return cell


def discover(path: Path) -> list[Section]:
    """The sections of a folder: a run, a run_matrix sweep, a multirun (its summary, then each
    job named by its swept values), or a folder of those one level down."""
    path = Path(path)
    if (path / "results.jsonl").is_file():
        return [redacted(matrix_section(path))]
    if (path / RUN_FILE).is_file():
        label = ""
        if (path.parent / MULTIRUN_FILE).is_file():
            label = dict((str(p), lab) for p, lab in multirun_jobs(path.parent)).get(str(path), "")
        return [redacted(experiment_section(path, label))]
    if (path / MULTIRUN_FILE).is_file():
        jobs = multirun_jobs(path)
        return [redacted(multirun_section(path, jobs))] + [
            redacted(experiment_section(job, label)) for job, label in jobs
        ]
    inside = sorted(p for p in path.iterdir() if p.is_dir() and _is_run(p)) if path.is_dir() else []
    if inside:
        return [section for p in inside for section in discover(p)]
    raise ValueError(
        f"{path} is neither an experiment's run directory (no {RUN_FILE}), a run_matrix folder "
        f"(no results.jsonl), a multirun (no {MULTIRUN_FILE}) nor a folder holding any of them"
        + _runs_below(path)
    )


def _is_run(folder: Path) -> bool:
    return any((folder / name).is_file() for name in (RUN_FILE, "results.jsonl", MULTIRUN_FILE))


def _runs_below(path: Path) -> str:
    """`; runs further down: a, b` naming up to 5 run folders deeper inside `path`."""
    if not path.is_dir():
        return ""
    found = sorted({p.parent for name in (RUN_FILE, MULTIRUN_FILE, "results.jsonl")
                    for p in path.glob(f"*/*/**/{name}")})  # fmt: skip
    if not found:
        return ""
    shown = ", ".join(str(p) for p in found[:5]) + (", ..." if len(found) > 5 else "")
    return f"; runs further down: {shown}"


def redacted(section: Section) -> Section:
    """`section` with `***` for any secret its command, rows, notes or summary line quote."""
    head = section.headline
    return replace(
        section,
        command=redact_text(section.command),
        rows=[tuple(redact_text(cell) for cell in row) for row in section.rows],
        more=[tuple(redact_text(cell) for cell in row) for row in section.more],
        note=redact_text(section.note),
        remarks=[redact_text(r) for r in section.remarks],
        headline=None if head is None else replace(head, differs=redact_text(head.differs)),
    )


SUMMARY_INTRO = (
    "Each run's headline figure, what it means, and the benchmark figure the docs give for "
    "the same question. The runs here are as they ran: often short, on the tiny or debug "
    "models, perhaps beside other work; a benchmark runs longer, alone, with its stated "
    "settings and models. A short run on small models weighs fixed costs (starting processes, "
    "first calls, each message's round trip) far more, so expect the two to differ; the "
    "benchmark's command measures it again on this machine."
)


def write_report(run_dirs: list[Path], out_dir: Path, *, preface: str = "") -> Path:
    """Write `out_dir/index.html` and `index.md` for `run_dirs` (runs, sweeps, multiruns, or
    folders of them), a summary first; returns the HTML file."""
    sections = [section for d in run_dirs for section in discover(Path(d))]
    out_dir.mkdir(parents=True, exist_ok=True)
    images = out_dir / "images"
    images.mkdir(exist_ok=True)
    for number, section in enumerate(sections, start=1):
        copied = []
        for image in section.images:
            target = images / f"{number:02d}-{image.name}"
            shutil.copyfile(image, target)
            copied.append(target.relative_to(out_dir))
        section.images = copied
    created = time.strftime("%Y-%m-%d %H:%M:%S")
    (out_dir / "index.md").write_text(_markdown(sections, created, preface))
    page = out_dir / "index.html"
    page.write_text(_html(sections, created, preface, full_row=_full_row(sections, out_dir)))
    return page


HALF_ROW_PX = 580
"""The width a plot gets beside another on the report's page (1200 px less margins, halved)."""
LEGIBLE_SCALE = 0.65
"""The least a plot may be shrunk: its 10-point text, 15 px at lab.plots' 110 dpi, stays at
10 px or more. A plot that would shrink more beside another takes a row of its own."""


def _full_row(sections: list[Section], out_dir: Path) -> set[Path]:
    """The plots too wide to be shown half a row wide and still be read."""
    from PIL import Image

    wide = set()
    for image in (i for section in sections for i in section.images):
        try:
            with Image.open(out_dir / image) as png:
                width = png.width
        except (OSError, ValueError):  # a truncated or foreign file: shown as it is, half a row
            continue
        if width * LEGIBLE_SCALE > HALF_ROW_PX:
            wide.add(image)
    return wide


def _experiments(heads: list[Headline]) -> list[Headline]:
    """One headline per experiment, in order: what its figure means and its benchmark."""
    return list({h.experiment: h for h in reversed(heads)}.values())[::-1]


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _markdown(sections: list[Section], created: str, preface: str = "") -> str:
    lines = [f"# distributed-llm-lab report ({created})", ""]
    if preface:
        lines += [preface, ""]
    heads = [s.headline for s in sections if s.headline is not None]
    if heads:
        lines += ["## Summary", "", SUMMARY_INTRO, "",
                  "| run | figure | this run | why it may differ from the benchmark |",
                  "|---|---|---:|---|"]  # fmt: skip
        for h in heads:
            value = h.value + (f" ({h.comparable})" if h.comparable else "")
            lines.append("| " + " | ".join(_cell(c) for c in (
                h.run, h.figure, value, h.differs)) + " |")  # fmt: skip
        lines.append("")
        for h in _experiments(heads):
            lines += [f"- **{h.experiment}**, {h.figure}: {h.means}. Benchmark: {h.benchmark}."]
        lines.append("")
    for section in sections:
        lines += [f"## {section.title}", "", f"Command: `{section.command}`", "",
                  f"Machine: {section.machine}", ""]  # fmt: skip
        if section.note:
            lines += [section.note, ""]
        lines += [f"**Note:** {remark}" for remark in section.remarks]
        lines += [""] if section.remarks else []
        lines += ["| " + " | ".join(section.header) + " |",
                  "|" + "---|" * len(section.header)]  # fmt: skip
        lines += [
            "| " + " | ".join(_cell(c) for c in row) + " |"
            for row in [*section.rows, *section.more]
        ]
        lines += [""] + [f"![{image.stem}]({image})" for image in section.images] + [""]
    return "\n".join(lines)


STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;
color:#222}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
code{background:#f4f4f4;padding:.1em .3em}table{border-collapse:collapse;margin:.8em 0}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right;vertical-align:top}
td:first-child,th:first-child{text-align:left}td.text,th.text{text-align:left}
table.summary td{font-size:.92em}table.summary td.value{font-weight:bold;white-space:nowrap}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:.6em}
.plots img{width:100%;border:1px solid #eee}
.plots img.full{grid-column:1/-1;width:auto;max-width:100%;justify-self:start}
.machine,.note{color:#555}
.remark{color:#8b0000}.wide{overflow-x:auto}dd{margin:0 0 .5em 1.5em;color:#333}
details{margin:.4em 0}summary{cursor:pointer;color:#555}"""


def _rows_html(rows: list[tuple[str, ...]]) -> str:
    esc = html.escape
    return "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)


def _html(
    sections: list[Section], created: str, preface: str = "", *, full_row: set[Path] | None = None
) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>distributed-llm-lab report {esc(created)}</title><style>{STYLE}</style></head>",
        f"<body><h1>distributed-llm-lab report</h1><p class='note'>made {esc(created)} by "
        "<code>python -m labtools.report</code></p>",
    ]
    if preface:
        parts.append(f"<p>{esc(preface)}</p>")
    heads = [s.headline for s in sections if s.headline is not None]
    if heads:
        parts.append(f"<section id='summary'><h2>Summary</h2><p>{esc(SUMMARY_INTRO)}</p>")
        head = "".join(f"<th class='text'>{h}</th>" for h in (
            "run", "figure", "this run", "why it may differ from the benchmark"))  # fmt: skip
        body = "".join(
            f"<tr><td>{esc(h.run)}</td><td class='text'>{esc(h.figure)}</td>"
            f"<td class='value'>{esc(h.value)}"
            + (f"<br><small>{esc(h.comparable)}</small>" if h.comparable else "")
            + f"</td><td class='text'>{esc(h.differs)}</td></tr>"
            for h in heads
        )
        parts.append(f"<table class='summary'><thead><tr>{head}</tr></thead>"
                     f"<tbody>{body}</tbody></table>")  # fmt: skip
        parts.append("<dl>" + "".join(
            f"<dt><b>{esc(h.experiment)}</b>, {esc(h.figure)}</dt><dd>{esc(h.means)}. "
            f"<i>Benchmark:</i> {esc(h.benchmark)}.</dd>" for h in _experiments(heads)
        ) + "</dl></section>")  # fmt: skip
    for section in sections:
        parts.append(f"<section><h2>{esc(section.title)}</h2>")
        parts.append(f"<p>Command: <code>{esc(section.command)}</code></p>")
        parts.append(f"<p class='machine'>Machine: {esc(section.machine)}</p>")
        if section.note:
            parts.append(f"<p class='note'>{esc(section.note)}</p>")
        parts += [f"<p class='remark'>{esc(remark)}</p>" for remark in section.remarks]
        head = "".join(f"<th>{esc(h)}</th>" for h in section.header)
        parts.append(f"<div class='wide'><table><thead><tr>{head}</tr></thead>"
                     f"<tbody>{_rows_html(section.rows)}</tbody></table></div>")  # fmt: skip
        if section.more:
            parts.append(
                f"<details><summary>{len(section.more)} more metrics</summary><table><thead>"
                f"<tr>{head}</tr></thead><tbody>{_rows_html(section.more)}</tbody></table>"
                "</details>"
            )
        if section.images:
            parts.append("<div class='plots'>" + "".join(
                f"<img src='{esc(str(i))}' alt='{esc(i.stem)}'"
                + (" class='full'>" if i in (full_row or set()) else ">")
                for i in section.images
            ) + "</div>")  # fmt: skip
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m labtools.report", description="One HTML + Markdown report from run folders."
    )
    parser.add_argument(
        "run_dirs",
        nargs="+",
        type=Path,
        help="run directories, run_matrix folders, multirun folders, or folders of them",
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="report folder (default: reports/<timestamp>)")  # fmt: skip
    args = parser.parse_args(argv)
    out = args.out or Path("reports") / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        page = write_report(args.run_dirs, out)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"labtools.report: {exc}\n")
    print(f"report: {page.resolve()}")


if __name__ == "__main__":
    main()
