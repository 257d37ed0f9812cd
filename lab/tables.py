"""How the lab prints numbers and tables: a metric's unit from its name, its value in a fixed
precision for that unit, and a rich table printed whole where stdout is no terminal.

Used by every run's final table (lab.tracking), a multirun's summary (lab.multirun), the report
(labtools.report) and run_matrix's table.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rich.console import Console

UNITS: tuple[tuple[str, str], ...] = (
    (r"tokens_per_s$", "tokens/s"),
    (r"(^|_)ms($|_)", "ms"),
    (r"(^|_)(s|seconds)$", "s"),
    (r"bytes", "B"),
    (r"_mib$", "MiB"),
    (r"_gib$", "GiB"),
    (r"params_m$", "M parameters"),
    (r"params$", "parameters"),
    (r"loss", "nats/token"),
    (r"(ratio|speedup|_over_)", "x"),
    (r"(share|rate|match|agreement)$", "fraction"),
)
"""A metric's unit from its name, first match wins (the lab names metrics by what they hold)."""


def unit_of(key: str) -> str:
    """The unit of metric `key` (`token_ms_p50`: ms, `tokens_per_s`: tokens/s); "" for a count."""
    for pattern, unit in UNITS:
        if re.search(pattern, key):
            return unit
    return ""


def fixed(value: Any, unit: str = "") -> str:
    """`value` in a fixed precision for its unit and size, never in exponent form above 0.001:
    4 decimals for a loss, 3 for a fraction, 2 for a ratio, thousands separated."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if isinstance(value, int) or (unit in ("", "B", "parameters") and value == int(value)):
        return f"{int(value):,}"
    size = abs(value)
    if unit == "nats/token":
        return f"{value:.4f}"
    if unit == "fraction":
        return f"{value:.3f}"
    if unit == "x":
        return f"{value:.2f}"
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 0.001 or value == 0:
        return f"{value:.3f}" if size < 10 else f"{value:.2f}"
    return f"{value:.2e}"


def with_unit(value: Any, unit: str) -> str:
    """`fixed(value)` with its unit: `1.23x`, `16.12 ms`, `0.712` (a fraction has none)."""
    text = fixed(value, unit)
    if unit == "x":
        return f"{text}x"
    return f"{text} {unit}" if unit and unit != "fraction" else text


WIDEST = 320
"""The widest a table is printed where stdout is no terminal (a pipe, a file, a log)."""


def print_wide(table: Any, console: Console | None = None) -> None:
    """Print a rich table whole: where stdout is no terminal (piped, into a log) rich would cut
    it to 80 columns and its headers to a few letters; there it is printed at its natural
    width instead (up to WIDEST). A terminal folds what does not fit."""
    console = console or Console()
    if not console.is_terminal:
        natural = console.measure(table, options=console.options.update_width(WIDEST)).maximum
        width = min(max(natural, 80), WIDEST)
        console = Console(file=console.file, width=width, color_system=None)
    console.print(table)
