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
from lab.tracking import METRICS_FILE, RUN_FILE, read_records

SWEEP_FILE = "sweep.json"
"""run_matrix's record of a sweep: its command and configuration."""


@dataclass
class Section:
    title: str
    command: str
    machine: str
    rows: list[tuple[str, ...]]
    header: tuple[str, ...]
    images: list[Path] = field(default_factory=list)
    note: str = ""


def _machine_line(machine: dict[str, Any] | None) -> str:
    if not machine:
        return "not recorded"
    device = machine.get("device_name") or machine.get("device", "")
    return (
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"{machine.get('memory_gib', '?')} GiB, {machine.get('system', '')}, device {device}; "
        f"torch {machine.get('packages', {}).get('torch', '?')}"
    )


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def experiment_section(run_dir: Path) -> Section:
    info = json.loads((run_dir / RUN_FILE).read_text())
    records = read_records(run_dir / METRICS_FILE)
    summaries = [r for r in records if r.get("kind") == "summary"]
    summary = {k: v for k, v in (summaries[-1] if summaries else {}).items() if k != "kind"}
    images = sorted(run_dir.glob("*.png")) or draw_run(run_dir, info["job"])
    return Section(
        title=f"{info['job']} ({run_dir.name})",
        command=info.get("command", ""),
        machine=_machine_line(info.get("machine")),
        header=("metric", "value"),
        rows=[(key, _format(value)) for key, value in summary.items() if key != "time_s"],
        images=images,
        note="" if summaries else "the run has no summary: it did not finish",
    )


def matrix_section(out_dir: Path) -> Section:
    from labtools.matrix import Results

    sweep = (
        json.loads((out_dir / SWEEP_FILE).read_text()) if (out_dir / SWEEP_FILE).is_file() else {}
    )
    records = Results(out_dir).records()
    latest: dict[str, dict[str, Any]] = {}
    for record in records:
        latest[record["cell"]] = record
    cells = sorted(latest.values(), key=lambda r: r.get("index", 0))
    metric_keys = sweep.get("metrics", [])[:4]
    rows = []
    for record in cells:
        values = record.get("metrics", {})
        rows.append((
            record["cell"],
            record["status"] + (f": {record['reason']}" if record["status"] != "ok" else ""),
            *(_format(values[k]) if k in values else "" for k in metric_keys),
            f"{record.get('seconds', 0):.0f}",
        ))  # fmt: skip
    ok = sum(r["status"] == "ok" for r in cells)
    return Section(
        title=f"run_matrix: {sweep.get('workload', out_dir.name)}",
        command=sweep.get("command", "python run_matrix.py"),
        machine=_machine_line(cells[0].get("machine") if cells else None),
        header=("cell", "status", *metric_keys, "s"),
        rows=rows,
        images=sorted((out_dir / "heatmaps").glob("*.png")),
        note=f"cells ok: {ok} of {len(cells)}",
    )


def section_for(run_dir: Path) -> Section:
    run_dir = Path(run_dir)
    if (run_dir / "results.jsonl").is_file():
        return redacted(matrix_section(run_dir))
    if (run_dir / RUN_FILE).is_file():
        return redacted(experiment_section(run_dir))
    raise ValueError(
        f"{run_dir} is neither an experiment's run directory (no {RUN_FILE}) nor a run_matrix "
        "folder (no results.jsonl)"
    )


def redacted(section: Section) -> Section:
    """`section` with `***` for any secret its command, rows or note quote."""
    return replace(
        section,
        command=redact_text(section.command),
        rows=[tuple(redact_text(cell) for cell in row) for row in section.rows],
        note=redact_text(section.note),
    )


def write_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """Write `out_dir/index.html` and `index.md` for `run_dirs`; returns the HTML file."""
    sections = [section_for(Path(d)) for d in run_dirs]
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
    (out_dir / "index.md").write_text(_markdown(sections, created))
    page = out_dir / "index.html"
    page.write_text(_html(sections, created))
    return page


def _markdown(sections: list[Section], created: str) -> str:
    lines = [f"# distributed-llm-lab report ({created})", ""]
    for section in sections:
        lines += [f"## {section.title}", "", f"Command: `{section.command}`", "",
                  f"Machine: {section.machine}", ""]  # fmt: skip
        if section.note:
            lines += [section.note, ""]
        lines += ["| " + " | ".join(section.header) + " |",
                  "|" + "---|" * len(section.header)]  # fmt: skip
        lines += [
            "| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in section.rows
        ]
        lines += [""] + [f"![{image.stem}]({image})" for image in section.images] + [""]
    return "\n".join(lines)


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
code{background:#f4f4f4;padding:.1em .3em}table{border-collapse:collapse;margin:.8em 0}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
td:first-child,th:first-child{text-align:left}
img{max-width:100%;margin:.5em 0;border:1px solid #eee}.machine,.note{color:#555}"""


def _html(sections: list[Section], created: str) -> str:
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>distributed-llm-lab report {esc(created)}</title><style>{STYLE}</style></head>",
        f"<body><h1>distributed-llm-lab report</h1><p class='note'>made {esc(created)} by "
        "<code>python -m labtools.report</code></p>",
    ]
    for section in sections:
        parts.append(f"<section><h2>{esc(section.title)}</h2>")
        parts.append(f"<p>Command: <code>{esc(section.command)}</code></p>")
        parts.append(f"<p class='machine'>Machine: {esc(section.machine)}</p>")
        if section.note:
            parts.append(f"<p class='note'>{esc(section.note)}</p>")
        head = "".join(f"<th>{esc(h)}</th>" for h in section.header)
        body = "".join(
            "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in section.rows
        )
        parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        parts += [f"<img src='{esc(str(i))}' alt='{esc(i.stem)}'>" for i in section.images]
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m labtools.report", description="One HTML + Markdown report from run folders."
    )
    parser.add_argument(
        "run_dirs", nargs="+", type=Path, help="run directories or run_matrix folders"
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
