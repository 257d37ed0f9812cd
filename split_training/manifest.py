"""What the lab's tools need from split_training (lab.registry): its sweep, plots, headline and
its cost model on a link, its roles across hosts, its curve and the stranger's attacks on its
ports, its quick settings.

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from lab.linkmodel import Link, run_config, run_steps
from lab.plots import pyplot, rising_validation, save, smoothed, step_rows
from lab.records import METRICS_FILE, read_records, same_losses
from lab.registry import Headline, Manifest, Metric, Scenario, Variant, Workload
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


SPLIT_TRAINING_CROSSINGS = 13
"""Per step with 2 stages: forward 5 (driver -> stage 1; stage 1's output, an RRef the driver
hands stage 2, confirmed with its owner and fetched; the loss back), backward 4, the gradient
norm 2 and DistributedOptimizer.step 2."""
CLIP_CROSSINGS = 2
"""On steps where the norm exceeds split.grad_clip: the scaling, on both stages."""
TIE_CROSSINGS = 8
"""A tied embedding / head: stage 1 fetches stage 2's gradient and hands back the sum, two
nested RPCs through an RRef the driver passed (each with its owner's confirmation)."""


def predict_step_ms(run_dir: Path, link: Link) -> float:
    """The local step plus its sequential crossings (13; 2 more where the
    gradient is clipped, 8 more for a tied embedding) and the activations forward and their
    gradients backward at the link's rate. The counts were read from the code and checked once
    with each phase of a step timed at 20 ms one way, a delay outside the judged grid."""
    config = run_config(run_dir)
    split = config["split"]
    if int(split["num_stages"]) != 2 or int(split.get("grad_accum_steps", 1)) != 1:
        raise ValueError("the model covers split_training with 2 stages and no accumulation")
    steps = run_steps(run_dir, "step_s")[1:]
    clip = float(split.get("grad_clip", 0.0) or 0.0)
    clipped = (
        sum(float(s.get("grad_norm", 0.0)) > clip for s in steps) / len(steps)
        if clip > 0 and steps
        else 0.0
    )
    # the sync runs on every step, tied or not (an untied model's returns early, after its
    # round trips: skipping it drifted cross-host losses by 1.4e-4, so it stays for now)
    crossings = SPLIT_TRAINING_CROSSINGS + CLIP_CROSSINGS * clipped + TIE_CROSSINGS
    activations = int(split["batch_size"]) * int(split["block_size"]) * hidden_size(config) * 4
    return step_ms(run_dir) + 1e3 * (crossings * link.one_way_s + 2 * link.serialize_s(activations))


MANIFEST = Manifest(
    name=NAME,
    summary="backprop across the cut: distributed autograd and DistributedOptimizer",
    headline=Headline(
        "step_ms",
        "training step (ms, median)",
        step_ms,
        predict_step_ms,
        means="one optimizer step, forward and backward across the stages; tokens_per_s is the "
        "same in tokens, idle_share the time a stage waited",
        benchmark="610 tokens/s with 4 micro-batches, 1.69x one micro-batch (random-init "
        "Llamas, `python bench/split_bench.py`, loopback, a 2-core AMD EPYC)",
        benchmark_key="tokens_per_s",
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
        "master",
        SPLIT_ROLES,
        ACROSS,
        same_losses("loss"),
        result_role="driver",
        netproto=False,
    ),
    variants=(Variant(NAME, NAME, [*ACROSS, "split.steps=8"]),),
    # long enough for the stranger's tries to find the run listening
    exposure=("split.steps=300",),
)
