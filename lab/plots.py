"""Each experiment's own plots, drawn from its run directory's metrics.jsonl when the run ends.

`draw_run(run_dir, job)` is called by the tracker on a successful close, and by
`labtools.report` for runs that have none yet. Every plot is a PNG beside the metrics it shows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.records import METRICS_FILE, read_records

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _steps(records: list[dict[str, Any]], *keys: str) -> list[dict[str, Any]]:
    return [
        r
        for r in records
        if r.get("kind") == "metrics" and "step" in r and all(k in r for k in keys)
    ]


def fed_learn(run_dir: Path) -> list[Path]:
    """Validation loss per round, and bytes each way per round."""
    source = run_dir / "coordinator" / METRICS_FILE  # a local run: the coordinator's rounds
    records = read_records(source if source.is_file() else run_dir / METRICS_FILE)
    rounds = _steps(records, "val_loss")
    if not rounds:
        return []
    plt = _pyplot()
    fig, (loss_ax, bytes_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    loss_ax.plot([r["step"] for r in rounds], [r["val_loss"] for r in rounds], marker="o")
    loss_ax.set_xlabel("round (0: before training)")
    loss_ax.set_ylabel("validation loss (nats/token)")
    loss_ax.set_title("global model")
    traffic = [r for r in rounds if "bytes_up" in r]
    if traffic:
        steps = [r["step"] for r in traffic]
        width = 0.4
        bytes_ax.bar([s - width / 2 for s in steps], [r["bytes_up"] / 1e3 for r in traffic],
                     width, label="up (clients to coordinator)")  # fmt: skip
        bytes_ax.bar([s + width / 2 for s in steps], [r["bytes_down"] / 1e3 for r in traffic],
                     width, label="down")  # fmt: skip
        bytes_ax.legend(fontsize=8)
    bytes_ax.set_xlabel("round")
    bytes_ax.set_ylabel("kB per round")
    bytes_ax.set_title("traffic (adapters only)")
    from matplotlib.ticker import MaxNLocator

    for ax in (loss_ax, bytes_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole
        ax.grid(alpha=0.3)
    return [_save(fig, plt, run_dir / "fed_rounds.png")]


def spec_decoding(run_dir: Path) -> list[Path]:
    """Acceptance rate and speedup over the target alone, per prompt."""
    prompts = _steps(read_records(run_dir / METRICS_FILE), "acceptance_rate")
    if not prompts:
        return []
    plt = _pyplot()
    fig, (acc_ax, speed_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    numbers = [r["step"] + 1 for r in prompts]
    acc_ax.bar(numbers, [r["acceptance_rate"] for r in prompts])
    acc_ax.set_ylim(0, 1)
    acc_ax.set_ylabel("drafted tokens accepted (fraction)")
    acc_ax.set_title("acceptance")
    if all("speedup" in r for r in prompts):
        speed_ax.bar(numbers, [r["speedup"] for r in prompts], label="measured")
        speed_ax.plot(numbers, [r["predicted_speedup"] for r in prompts], "k_", markersize=20,
                      mew=2, label="predicted by the cost model")  # fmt: skip
        speed_ax.axhline(1.0, color="grey", lw=1)
        speed_ax.legend(fontsize=8)
    speed_ax.set_ylabel("tokens/s over the target alone (x)")
    speed_ax.set_title("speedup")
    for ax in (acc_ax, speed_ax):
        ax.set_xlabel("prompt")
        ax.set_xticks(numbers)
        ax.grid(alpha=0.3, axis="y")
    return [_save(fig, plt, run_dir / "spec_prompts.png")]


def split_inference(run_dir: Path) -> list[Path]:
    """Per-token latency (p50 and p95) per batch, split across stages vs the unsplit model."""
    records = read_records(run_dir / METRICS_FILE)
    split = {r["step"]: r for r in _steps(records, "token_ms_p50")}
    unsplit = {r["step"]: r for r in _steps(records, "unsplit_token_ms_p50")}
    if not split:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    batches = sorted(split)
    width = 0.38
    for offset, rows, prefix, label in (
        (-width / 2, split, "", "split"),
        (width / 2, unsplit, "unsplit_", "unsplit"),
    ):
        shown = [b for b in batches if b in rows]
        if not shown:
            continue
        where = [b + 1 + offset for b in shown]
        p50 = [rows[b][f"{prefix}token_ms_p50"] for b in shown]
        p95 = [rows[b][f"{prefix}token_ms_p95"] for b in shown]
        bars = ax.bar(where, p50, width, label=f"{label} p50 (bar)")
        colour = bars.patches[0].get_facecolor()
        ax.plot(where, p95, "_", color=colour, markersize=22, mew=3, linestyle="none",
                label=f"{label} p95 (tick)")  # fmt: skip
    ax.set_xlabel("measured batch (after the warm-up)")
    ax.set_xticks([b + 1 for b in batches])
    ax.set_ylabel("per-token latency (ms)")
    ax.set_title("decoding: split across stages vs one process")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return [_save(fig, plt, run_dir / "split_latency.png")]


def split_training(run_dir: Path) -> list[Path]:
    """The training loss per optimizer step (the step numbers logged: a resumed run goes on),
    smoothed, and the validation loss where it was measured."""
    records = read_records(run_dir / METRICS_FILE)
    steps = _steps(records, "loss")
    if not steps:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    numbers, losses = [r["step"] for r in steps], [r["loss"] for r in steps]
    ax.plot(numbers, losses, alpha=0.35, lw=1, label="per step")
    if len(losses) >= 5:
        ax.plot(numbers, smoothed(losses), lw=2, label="smoothed (EMA, 0.9)")
    val = _steps(records, "val_loss")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o", color="black",
                markersize=5, label="validation (held-out text)")  # fmt: skip
    ax.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("split training")
    ax.grid(alpha=0.3)
    return [_save(fig, plt, run_dir / "loss_curve.png")]


def smoothed(values: list[float], *, decay: float = 0.9) -> list[float]:
    """An exponential moving average, bias-corrected so its first points are not pulled to 0."""
    average, out = 0.0, []
    for n, value in enumerate(values, start=1):
        average = decay * average + (1 - decay) * value
        out.append(average / (1 - decay**n))
    return out


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


PLOTS: dict[str, Callable[[Path], list[Path]]] = {
    "fed_learn": fed_learn,
    "spec_decoding": spec_decoding,
    "split_inference": split_inference,
    "split_training": split_training,
}


def draw_run(run_dir: Path, job: str) -> list[Path]:
    """The plots of run `job` in `run_dir` (none for a job without plots or without data)."""
    draw = PLOTS.get(job)
    return [] if draw is None else draw(Path(run_dir))
