"""The benchmark figures the docs and the manifests quote, read from one place.

Every bench writes its results to `bench/results/<name>.json` (lab.machine.write_results). A
figure quoted elsewhere names where it lives there, so it is never typed twice:

- a manifest's benchmark text calls `figure("split_bench", "rows > decode latency > ratio")`;
- a README or docs figure carries a tag right after it, an HTML comment a reader does not
  see: `**1.43x**<!-- bench split_bench: rows > decode latency > ratio -->`, optionally with a
  scale (`26%<!-- bench split_bench: rows > training, m=4 vs m=1 > idle_share_m4 * 100 -->`).
  `check_tags` (run by `make readme-check`) compares each tagged figure with the results at
  the precision it is printed with, so a rerun bench that moves a figure fails the check
  until the page says what the file says.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
CURVES = RESULTS.parent.parent / "docs" / "curves"
"""`python -m labtools.hosts curves` writes each variant's grid here (docs/hosts.md)."""

TAG = re.compile(
    r"<!--\s*bench\s+(?P<name>[\w.-]+)\s*:(?P<path>[^*]*?)(?:\*\s*(?P<scale>[\d.e+-]+))?\s*-->"
)
"""A figure's tag: `<!-- bench NAME: KEY > KEY > ... [* SCALE] -->`."""

FIGURE = re.compile(r"(?P<number>-?\d[\d,]*(?:\.\d+)?)(?P<unit>[^\d<>]{0,12})$")
"""The figure a tag follows: the last number before it, with at most a short unit between
(`1.43x**`, `495`, `26%`, ` ms`)."""


CODE = re.compile(r"```.*?^```|`[^`]*`", re.DOTALL | re.MULTILINE)
"""A fenced code block, or an inline code span (which may run over lines)."""


def without_examples(text: str) -> str:
    """`text` with every tag inside code blanked out: a tag shown as an example of one (in
    `code`) is not a figure's; the lines keep their numbers and lengths."""
    return CODE.sub(lambda span: TAG.sub(lambda tag: " " * len(tag[0]), span[0]), text)


class BenchFigureError(ValueError):
    """A figure that is not in bench/results: names the file, the key and what to run."""


def _results(path: Path) -> dict[str, Any]:
    return _parsed(path, path.stat().st_mtime_ns)  # (a rewritten file is read again)


@cache
def _parsed(path: Path, _mtime_ns: int) -> dict[str, Any]:
    return json.loads(path.read_text())


def figure(name: str, keys: str, *, results: Path | None = None) -> float:
    """The figure at `keys` ("rows > decode latency > ratio") of bench/results/`name`.json."""
    path = (results or RESULTS) / f"{name}.json"
    if not path.is_file():
        raise BenchFigureError(f"{path} is missing: run `python bench/{name}.py` to write it")
    value: Any = _results(path)
    keys = keys.strip()
    for key in (k.strip() for k in keys.split(">")):
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]  # a list of rows: its index
        elif isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise BenchFigureError(f"{path} has no {keys!r} (no {key!r} there)")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BenchFigureError(f"{path}: {keys!r} is {value!r}, not a number")
    return float(value)


def machine(name: str, *, results: Path | None = None) -> str:
    """The machine bench/results/`name`.json was measured on, in a few words."""
    path = (results or RESULTS) / f"{name}.json"
    if not path.is_file():
        raise BenchFigureError(f"{path} is missing: run `python bench/{name}.py` to write it")
    about = _results(path).get("machine", {})
    return f"a {about.get('cores', '?')}-core {about.get('cpu', 'machine')}"


def curve(variant: str, *, delay_ms: float, rate: str, curves: Path | None = None) -> float:
    """The measured figure of one cell of docs/curves/`variant`.csv (the hosts harness's
    delay x rate grid)."""
    path = (curves or CURVES) / f"{variant}.csv"
    if not path.is_file():
        raise BenchFigureError(f"{path} is missing: run `python -m labtools.hosts curves`")
    with path.open(newline="") as rows:
        for row in csv.DictReader(rows):
            if float(row["settings.delay_ms"]) == delay_ms and row["settings.rate"] == rate:
                return float(row["metrics.measured"])
    raise BenchFigureError(f"{path} has no cell delay={delay_ms:g} rate={rate}")


def text(make: Callable[[], str]) -> str:
    """`make()`, a manifest's benchmark text built from these figures, or why it cannot be."""
    try:
        return make()
    except BenchFigureError as exc:
        return f"not available ({exc})"


@dataclass(frozen=True)
class Mismatch:
    where: str
    """file:line of the figure."""
    printed: str
    expected: str
    """The results' figure at the printed precision, or why there is none."""


def _decimals(printed: str) -> int:
    return len(printed.split(".", 1)[1]) if "." in printed else 0


def check_line(line: str, *, where: str, results: Path | None = None) -> tuple[int, list[Mismatch]]:
    """(tags on the line, the figures among them that differ from bench/results)."""
    found, wrong = 0, []
    for tag in TAG.finditer(line):
        found += 1
        before = FIGURE.search(line[: tag.start()].rstrip("*_ "))
        if before is None:
            wrong.append(Mismatch(where, "", "no figure right before the tag"))
            continue
        printed = before["number"]
        try:
            value = figure(tag["name"], tag["path"], results=results)
        except BenchFigureError as exc:
            wrong.append(Mismatch(where, printed, str(exc)))
            continue
        value *= float(tag["scale"]) if tag["scale"] else 1.0
        digits = _decimals(printed)
        expected = f"{value:,.{digits}f}" if "," in printed else f"{value:.{digits}f}"
        if math.isnan(value) or expected != printed:
            wrong.append(Mismatch(where, printed, expected))
    return found, wrong


def check_tags(
    files: Iterable[Path], *, root: Path, results: Path | None = None
) -> tuple[int, list[Mismatch]]:
    """(tagged figures in `files`, those that differ from bench/results at their precision)."""
    total, wrong = 0, []
    for path in files:
        shown = path.relative_to(root) if path.is_relative_to(root) else path
        for number, line in enumerate(without_examples(path.read_text()).splitlines(), start=1):
            found, bad = check_line(line, where=f"{shown}:{number}", results=results)
            total += found
            wrong += bad
    return total, wrong
