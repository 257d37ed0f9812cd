"""What the lab's tools need from split_training (lab.registry): its sweep, plots, headline and
its cost model on a link, its roles across hosts, its curve and the stranger's attacks on its
ports, its quick settings.

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lab.benchfigures import figure, machine, text
from lab.linkmodel import Link, run_config, run_steps
from lab.plots import pyplot, rising_validation, save, smoothed, step_rows
from lab.records import METRICS_FILE, read_records, same_losses
from lab.registry import Headline, Manifest, Metric, Scenario, Variant, Workload
from split_engine.config import UNREAD
from split_engine.placement import ACROSS, DOCUMENTED, SPLIT_ROLES

NAME = "split_training"


def plots(run_dir: Path) -> list[Path]:
    """The training loss per optimizer step (the step numbers logged: a resumed run goes on),
    smoothed, and the validation loss where it was measured."""
    records = read_records(run_dir / METRICS_FILE)
    steps = step_rows(records, "loss")
    if not steps:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    numbers, losses = [r["step"] for r in steps], [r["loss"] for r in steps]
    ax.plot(numbers, losses, alpha=0.35, lw=1, label="per step")
    if len(losses) >= 5:
        ax.plot(numbers, smoothed(losses), lw=2, label="smoothed (EMA, 0.9)")
    val = step_rows(records, "val_loss")
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
    remark = rising_validation([(r["step"], r["val_loss"]) for r in val], losses)
    return [save(fig, plt, run_dir / "loss_curve.png", remark=remark)]


def hidden_size(config: dict[str, Any]) -> int:
    """The model's hidden size: a lab preset's, or the `config.json` of its local folder."""
    from lab.pretrain import load_preset

    model = config["model"]
    if str(model.get("pretrained", "")).startswith("lab:") and model.get("lab_preset"):
        preset = load_preset(str(model["lab_preset"]))
        which = str(model["pretrained"]).removeprefix("lab:").removeprefix("tiny_")
        return int(getattr(preset, which).hidden_size)
    path = Path(str(model["pretrained"])) / "config.json"
    if path.is_file():
        return int(json.loads(path.read_text())["hidden_size"])
    raise ValueError(f"cannot tell the hidden size of {model.get('pretrained')!r}")


def step_ms(run_dir: Path) -> float:
    """The median training step, the first (warm-up) left out."""
    steps = [float(r["step_s"]) for r in run_steps(run_dir, "step_s")][1:]
    if not steps:
        raise ValueError(f"no training steps after the first in {run_dir}")
    return 1e3 * statistics.median(steps)


def crossings(stages: int, *, schedule: str = "gpipe", microbatches: int = 4) -> float:
    """One-way link delays a step waits for, read from the code path (split_training.pipeline):
    the driver's call reaching every stage (1), the forward down the stages (stages - 1), the
    backward back up (stages - 1), the first stage's squared norm reaching the others (1; a
    tied head's gradient went to the first stage during the backward, and the sum comes back
    with the norm), the answers (1): 2 x stages + 1 under GPipe, at any micro-batch count.
    1F1B lets the first stage have `stages` micro-batches in flight: each group of that many
    waits for its own round trip down the stages and back."""
    if stages < 1:
        raise ValueError(f"{stages} stages")
    rounds = 1 if schedule == "gpipe" else math.ceil(microbatches / stages)
    return 3 + 2 * (stages - 1) * rounds


def _tied(config: dict[str, Any]) -> bool:
    """Whether the run's model ties its embedding and head (the lab's presets do not)."""
    path = Path(str(config["model"].get("pretrained", ""))) / "config.json"
    return path.is_file() and bool(json.loads(path.read_text()).get("tie_word_embeddings"))


def _vocab(config: dict[str, Any]) -> int:
    path = Path(str(config["model"].get("pretrained", ""))) / "config.json"
    return int(json.loads(path.read_text())["vocab_size"])


def predict_step_ms(run_dir: Path, link: Link) -> float:
    """The local step plus its one-way delays (`crossings`), the batch's activations forward
    and their gradients back at the link's rate, and a tied matrix's gradient each way."""
    config = run_config(run_dir)
    split = config["split"]
    stages = int(split["num_stages"])
    count = crossings(
        stages,
        schedule=str(split.get("schedule", "gpipe")),
        microbatches=int(split.get("microbatches", 4)),
    )
    width = hidden_size(config)
    batch = int(split["batch_size"]) * int(split.get("grad_accum_steps", 1))
    activations = batch * int(split["block_size"]) * width * 4
    wire = 2 * link.serialize_s(activations) if stages > 1 else 0.0
    if stages > 1 and _tied(config):
        wire += 2 * link.serialize_s(_vocab(config) * width * 4)
    return step_ms(run_dir) + 1e3 * (count * link.one_way_s + wire)


def verdict(summary: Mapping[str, Any]) -> list[str]:
    """Split training's answer: its throughput, how much of it the stages spent waiting, and
    whether the loss fell."""
    idle, bubble = float(summary["idle_share"]), float(summary["idle_share_gpipe"])
    first, last = float(summary["first_loss"]), float(summary["final_loss"])
    return [
        f"split training: {float(summary['tokens_per_s']):.0f} tokens/s over "
        f"{float(summary['steps']):.0f} steps; training loss {first:.3f} -> {last:.3f} "
        + ("(it learned)." if last < first else "(it did not fall: more steps, or a higher lr)."),
        f"Each stage sat idle {idle:.0%} of the time (GPipe's bubble at these settings: "
        f"{bubble:.0%}): more micro-batches (split.microbatches) fill the pipeline; the "
        "benchmark, 4 micro-batches against 1: "
        + text(lambda: f"{bench('rows > training, m=4 vs m=1 > ratio'):.2f}x the tokens/s "
               "(`python bench/split_bench.py`)."),
    ]  # fmt: skip


def bench(keys: str) -> float:
    """A figure of bench/results/split_bench.json (lab.benchfigures)."""
    return figure("split_bench", keys)


MANIFEST = Manifest(
    name=NAME,
    schema="split_training.config:SplitTrainingRunConfig",
    endpoints=("cluster.master",),
    unread=UNREAD,
    summary="backprop across the cut: the stages pipeline each step among themselves over RPC",
    headline=Headline(
        "step_ms",
        "training step (ms, median)",
        step_ms,
        predict_step_ms,
        means="one optimizer step, forward and backward across the stages; tokens_per_s is the "
        "same in tokens, idle_share the time a stage waited",
        benchmark=lambda: (
            f"{bench('rows > training, m=4 vs m=1 > ours'):.0f} tokens/s with 4 micro-batches, "
            f"{bench('rows > training, m=4 vs m=1 > ratio'):.2f}x one micro-batch (random-init "
            f"Llamas, `python bench/split_bench.py`, loopback, {machine('split_bench')})"
        ),
        benchmark_key="tokens_per_s",
        verdict=verdict,
    ),
    workload=Workload(
        (
            Metric("step_ms", "step time", "ms"),
            Metric("tokens_per_s", "throughput", "tokens/s"),
            Metric("idle_share", "stage idle share", "fraction"),
        ),
        repeat=lambda cell, repeats: [f"split.steps={max(2, repeats)}"],
    ),
    quick=("split.steps=4", "split.max_train_blocks=64"),
    plots=plots,
    documented=DOCUMENTED,
    scenario=Scenario(
        NAME,
        "cluster.master",
        SPLIT_ROLES,
        ACROSS,
        # each stage adds its micro-batches in a fixed order: any link, the same numbers
        same_losses("loss", rtol=1e-6),
        result_role="driver",
        netproto=False,
        port=29530,
    ),
    variants=(Variant(NAME, NAME, [*ACROSS, "split.steps=8"]),),
    # long enough for the stranger's tries to find the run listening
    exposure=("split.steps=300",),
)
