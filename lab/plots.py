"""The plots of a run, drawn from its run directory's metrics.jsonl when the run ends: each
experiment's manifest draws its own (`Manifest.plots`) with the helpers here.

`draw_run(run_dir, job)` is called by the tracker on a successful close, and by
`labtools.report` for runs that have none yet. Every plot is a PNG beside the metrics it shows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lab import registry

log = logging.getLogger(__name__)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_rows(records: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r.get("kind") == "metrics" and "step" in r and all(k in r for k in keys)
    ]


def smoothed(values: list[float], *, decay: float = 0.9) -> list[float]:
    """An exponential moving average, bias-corrected so its first points are not pulled to 0."""
    average, out = 0.0, []
    for n, value in enumerate(values, start=1):
        average = decay * average + (1 - decay) * value
        out.append(average / (1 - decay**n))
    return out


LEGEND_CHECK = "legend-overlaps"
"""The PNG text key under which `save` records the legends that still cover data ("none")."""
INSIDE = ("upper right", "upper left", "lower left", "lower right", "center right",
          "center left", "upper center", "lower center")  # fmt: skip


def _data_boxes(ax: Any) -> tuple[Any, list[Any]]:
    """(the display points of `ax`'s plotted data, the display boxes of its bars): lines sampled
    along their segments (in data coordinates only: a reference line such as axhline is not
    data), scatter points, bar rectangles."""
    import numpy as np
    from matplotlib.collections import PathCollection
    from matplotlib.patches import Rectangle

    points = [np.empty((0, 2))]
    for line in ax.get_lines():
        if line.get_transform() != ax.transData or not line.get_visible():
            continue
        xy = np.asarray(line.get_xydata(), dtype=float)
        xy = xy[np.isfinite(xy).all(axis=1)]
        if line.get_linestyle() not in ("None", "none", "", " ") and len(xy) > 1:
            t = np.linspace(0, 1, 16)[:, None, None]  # points along every segment
            xy = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)
        if len(xy):
            points.append(ax.transData.transform(xy))
    for collection in ax.collections:
        offsets = np.asarray(collection.get_offsets(), dtype=float)
        if isinstance(collection, PathCollection) and len(offsets):
            points.append(collection.get_offset_transform().transform(offsets))
    bars = [patch.get_window_extent() for patch in ax.patches
            if isinstance(patch, Rectangle) and patch.get_visible()
            and patch.get_height() != 0 and patch is not ax.patch]  # fmt: skip
    return np.concatenate(points), bars


def _covers(box: Any, ax: Any) -> bool:
    points, bars = _data_boxes(ax)
    pad = 2.0  # display pixels: a marker's edge counts
    inside = (
        (points[:, 0] >= box.x0 - pad) & (points[:, 0] <= box.x1 + pad)
        & (points[:, 1] >= box.y0 - pad) & (points[:, 1] <= box.y1 + pad)
    )  # fmt: skip
    return bool(inside.any()) or any(box.overlaps(bar) for bar in bars)


def legend_overlaps(fig: Any) -> list[str]:
    """The titles (or numbers) of `fig`'s axes whose legend covers some of their plotted data,
    judged on matplotlib's drawn extents; [] when every legend is clear."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    covered = []
    for number, ax in enumerate(fig.axes):
        legend = ax.get_legend()
        if legend is not None and _covers(legend.get_window_extent(renderer), ax):
            covered.append(ax.get_title() or f"axes {number}")
    return covered


def place_legends(fig: Any) -> None:
    """Move every legend that covers its axes' data: to the first corner or side inside the
    axes where it covers nothing, else below the axes, outside them (the saved figure grows to
    hold it)."""
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None or not _covers(legend.get_window_extent(), ax):
            continue
        handles, labels = ax.get_legend_handles_labels()
        size = legend.prop.get_size()
        for loc in INSIDE:
            legend = ax.legend(handles, labels, loc=loc, fontsize=size)
            fig.canvas.draw()
            if not _covers(legend.get_window_extent(), ax):
                break
        else:
            ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18),
                      ncol=min(len(labels), 3), fontsize=size, frameon=False)  # fmt: skip


def save(fig: Any, plt: Any, path: Path, *, remark: str = "") -> Path:
    """Lay `fig` out, move any legend off its data (`place_legends`), and write it to `path`,
    its PNG text recording which legends still cover data (LEGEND_CHECK: "none"). A `remark`
    (validation loss rising: `rising_validation`) is written under the plots, in red."""
    if remark:
        import textwrap

        lines = textwrap.wrap(remark, width=int(fig.get_figwidth() * 15))
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=8, color="#8b0000", va="bottom")
        fig.tight_layout(rect=(0, 0.05 + 0.05 * len(lines), 1, 1))
    else:
        fig.tight_layout()
    place_legends(fig)
    covered = legend_overlaps(fig)
    if covered:
        log.warning("%s: a legend covers data in %s", path.name, ", ".join(covered))
    fig.savefig(path, dpi=110, bbox_inches="tight",
                metadata={LEGEND_CHECK: ", ".join(covered) or "none"})  # fmt: skip
    plt.close(fig)
    return path


def legend_check(png: Path) -> str:
    """What `save` recorded in `png` about its legends: "none" when none covers data."""
    from PIL import Image

    with Image.open(png) as image:
        return str(image.info.get(LEGEND_CHECK, "not recorded"))


def rising_validation(
    validation: list[tuple[float, float]],
    training: list[float] | None = None,
    *,
    share: float = 0.005,
    step: str = "step",
) -> str:
    """A remark when validation loss rises over the run: its last two points each more than
    `share` above its lowest, which came before them, and the last the higher (a rise that
    lasts, not one noisy evaluation of a short run); "" when it does not. Called overfitting
    only while the training loss, where given, fell. `validation`: (step, loss) pairs in step
    order."""
    if len(validation) < 3:
        return ""
    best_step, best = min(validation, key=lambda point: point[1])
    (before_step, before), (last_step, last) = validation[-2], validation[-1]
    if best_step >= before_step or before <= best * (1 + share) or last < before:
        return ""
    falling = training is not None and len(training) >= 2 and (
        smoothed(training)[-1] < smoothed(training)[0])  # fmt: skip
    return (
        f"validation loss rose from {best:.3f} ({step} {best_step:g}) to {last:.3f} "
        f"({step} {last_step:g})"
        + (" while training loss fell: the model fits its training text better than text it "
           "has not seen (overfitting); fewer steps, more data or a lower learning rate"
           if falling else "")
    )  # fmt: skip


def draw_run(run_dir: Path, job: str) -> list[Path]:
    """The plots of run `job` in `run_dir`, as its experiment's manifest draws them (none for a
    job that is no experiment, or one without plots or without data)."""
    manifest = registry.find(job)
    if manifest is None or manifest.plots is None:
        return []
    return manifest.plots(Path(run_dir))
