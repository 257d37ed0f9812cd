"""Heatmaps of a run_matrix sweep (seaborn): one PNG per metric, failed cells marked."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from lab.registry import Metric

FAILED_COLOUR = "#d9d9d9"


def _label(axis: str, key: str) -> str:
    return f"{axis} ({key})"


def _format(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 1000:
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.4g}"
    return f"{value:.2e}" if abs(value) < 1e-2 else f"{value:,.0f}"


def draw(
    records: Sequence[dict[str, Any]],
    metrics: Sequence[Metric],
    *,
    grid: dict[str, list[Any]],
    axes: dict[str, str],
    out_dir: Path,
    title: str,
    flagged: Collection[str] = (),
) -> list[Path]:
    """One PNG per metric over the grid's first two axes (rows: first, columns: second; a
    1-axis grid is one row). With more axes, one panel per combination of the others. A cell
    that failed is grey with its status written in it; a cell in `flagged` (its baseline off
    its group's: labtools.matrix.busy_baselines) says `busy?`. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(grid)
    row_axis = names[0]
    col_axis = names[1] if len(names) > 1 else None
    rest = names[2:]
    panels = _combinations({axis: grid[axis] for axis in rest})
    by_settings = {_key(r["settings"], names): r for r in records}
    written = []
    for metric in metrics:
        if not any(metric.key in r.get("metrics", {}) for r in records):
            continue
        rows, cols = grid[row_axis], grid[col_axis] if col_axis else [""]
        fig, panel_axes = plt.subplots(
            1,
            len(panels),
            figsize=(3.2 + 1.5 * len(cols) * len(panels), 2.2 + 0.8 * len(rows)),
            squeeze=False,
        )
        shows_spread, grey = False, False
        for panel, ax in zip(panels, panel_axes[0], strict=True):
            values = np.full((len(rows), len(cols)), np.nan)
            text = [["" for _ in cols] for _ in rows]
            for i, row in enumerate(rows):
                for j, col in enumerate(cols):
                    settings = {row_axis: row, **({col_axis: col} if col_axis else {}), **panel}
                    record = by_settings.get(_key(settings, names))
                    if record is None:
                        text[i][j] = "not run"
                    elif record["status"] != "ok":
                        text[i][j] = record["status"]
                    elif (value := record["metrics"].get(metric.key)) is None:
                        text[i][j] = "n/a"
                    else:
                        values[i, j] = value
                        spread = record["metrics"].get(f"{metric.key}_spread")
                        text[i][j] = (
                            _format(value)
                            + (
                                f"\n±{spread / 2:.0%}"
                                if spread is not None and spread >= 0.005
                                else ""
                            )
                            + ("\nbusy?" if record["cell"] in flagged else "")
                        )
            grey = grey or not np.isfinite(values).all()
            shows_spread = shows_spread or any("±" in cell for row in text for cell in row)
            options = colour_scale(metric, [float(v) for v in values[np.isfinite(values)]])
            ax.set_facecolor(FAILED_COLOUR)
            sns.heatmap(
                values,
                ax=ax,
                annot=np.array(text, dtype=object),
                fmt="",
                mask=~np.isfinite(values),
                cbar=ax is panel_axes[0][-1],
                cbar_kws={"label": metric.unit},
                xticklabels=[str(c) for c in cols],
                yticklabels=[str(r) for r in rows],
                linewidths=0.5,
                linecolor="white",
                **options,
            )
            for i, row_text in enumerate(text):  # failed cells: status on the grey background
                for j, cell_text in enumerate(row_text):
                    if not np.isfinite(values[i, j]):
                        ax.text(j + 0.5, i + 0.5, cell_text, ha="center", va="center",
                                color="#8b0000", fontweight="bold")  # fmt: skip
            ax.set_ylabel(_label(row_axis, axes[row_axis]))
            ax.set_xlabel(_label(col_axis, axes[col_axis]) if col_axis else "")
            if panel:
                ax.set_title(", ".join(f"{k}={v}" for k, v in panel.items()), fontsize=9)
        fig.suptitle(f"{title}\n{metric.label} ({metric.unit})", fontsize=10)
        note = footnote(
            spread=shows_spread,
            failed=grey,
            busy=any(r["cell"] in flagged for r in records),
        )
        if note:
            fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
        fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
        path = out_dir / f"{metric.key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


RATIO_SPAN = 2.0
"""A ratio's colour scale reaches at least RATIO_SPAN x and 1/RATIO_SPAN x: a 10% difference
is a pale tint, not the palette's ends."""


def colour_scale(metric: Metric, values: Sequence[float]) -> dict[str, Any]:
    """seaborn's colour options for `metric` over the cells' `values`: a ratio is diverging
    around 1, symmetric in log (2x and 0.5x equally far from 1), at least RATIO_SPAN either
    way; anything else sequential over its range."""
    if not metric.ratio or not values:
        return {"cmap": "viridis"}
    options: dict[str, Any] = {"cmap": "RdBu_r", "center": 1.0}
    if all(v > 0 for v in values):
        spread = max([math.log(RATIO_SPAN)] + [abs(math.log(v)) for v in values])
        options.update(vmin=math.exp(-spread), vmax=math.exp(spread))
    return options


def footnote(*, spread: bool, failed: bool, busy: bool = False) -> str:
    """The heatmap's footnote: only what its cells show (a ± spread, a grey failed cell, a
    cell whose baseline was off: the machine busy)."""
    parts = ["± half the spread (max-min)/median of the cell's repeats"] if spread else []
    parts += ["grey: the cell did not run or failed"] if failed else []
    parts += ["busy?: its baseline was off its group's (a busy machine?)"] if busy else []
    return "; ".join(parts)


def _combinations(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    import itertools

    if not grid:
        return [{}]
    names = list(grid)
    return [
        dict(zip(names, combo, strict=True))
        for combo in itertools.product(*(grid[n] for n in names))
    ]


def _key(settings: dict[str, Any], names: Sequence[str]) -> tuple[str, ...]:
    return tuple(str(settings.get(name)) for name in names)
