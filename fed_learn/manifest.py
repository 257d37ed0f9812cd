"""What the lab's tools need from fed_learn (lab.registry): its sweep, plots, headline and its
cost model on a link, its roles across hosts, its curves and faults, its quick settings.

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lab.benchfigures import curve, text
from lab.linkmodel import Link, run_steps
from lab.plots import pyplot, rising_validation, save, step_rows
from lab.records import LOSS_RTOL, METRICS_FILE, read_records, same_losses, step_metrics
from lab.registry import (
    Fault,
    Headline,
    Manifest,
    Metric,
    RunningRoles,
    Scenario,
    Variant,
    Workload,
)

NAME = "fed_learn"
DEBUG = ["model.lab_preset=debug"]
SHORT = ["fed.rounds=2", "fed.local_steps=5", "fed.eval_blocks=8",
         "fed.max_examples_per_client=64", "fed.centralized_baseline=false"]  # fmt: skip
"""Two short rounds on 64 examples a client, without the centralized baseline."""
TWO_CLIENTS = ["fed.num_clients=2", "fed.min_fit_clients=2"]


def plots(run_dir: Path) -> list[Path]:
    """Validation loss per round, and bytes each way per round."""
    source = run_dir / "coordinator" / METRICS_FILE  # a local run: the coordinator's rounds
    records = read_records(source if source.is_file() else run_dir / METRICS_FILE)
    rounds = step_rows(records, "val_loss")
    if not rounds:
        return []
    plt = pyplot()
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
    remark = rising_validation([(r["step"], r["val_loss"]) for r in rounds], step="round")
    return [
        save(fig, plt, run_dir / "fed_rounds.png", remark=remark),
        *client_plot(run_dir, records),
    ]


PER_CLIENT = "client_eval_loss/"  # fed_learn.evaluation.PER_CLIENT (no model code imported here)


def client_plot(run_dir: Path, records: list[dict]) -> list[Path]:
    """Federated evaluation (fed.evaluate_on_clients): each client's loss on its own held-out
    data per round, and the token-weighted mean."""
    rounds = step_rows(records, "client_eval_loss")
    if not rounds:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    clients = sorted(
        {k for r in rounds for k in r if k.startswith(PER_CLIENT)},
        key=lambda k: int(k.removeprefix(PER_CLIENT)),
    )
    for key in clients:
        points = [(r["step"], r[key]) for r in rounds if key in r]
        ax.plot(
            *zip(*points, strict=True),
            marker=".",
            alpha=0.6,
            label=f"client {key.removeprefix(PER_CLIENT)}",
        )
    ax.plot(
        [r["step"] for r in rounds],
        [r["client_eval_loss"] for r in rounds],
        color="black",
        linewidth=2,
        marker="o",
        label="mean (by tokens)",
    )
    ax.set_xlabel("round")
    ax.set_ylabel("loss on its own held-out data")
    ax.set_title("federated evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return [save(fig, plt, run_dir / "fed_client_eval.png")]


def round_s(run_dir: Path) -> float:
    """The mean round time of a run."""
    rounds = [float(r["round_s"]) for r in run_steps(run_dir, "round_s")]
    if not rounds:
        raise ValueError(f"no rounds in {run_dir}")
    return statistics.mean(rounds)


def predict_round_s(run_dir: Path, link: Link) -> float:
    """Synchronous rounds: each local round plus the global adapters out through the
    coordinator's link (every client's, one after the other) and a client's update back through
    its own: 2 crossings, each after an idle spell. Each connection starts its transfer from the
    initial window in the first round (a new connection) and in any round after an idle spell
    longer than the link's RTO (a round's training: the local round's time); otherwise its
    window is still open."""
    rounds = run_steps(run_dir, "round_s")
    if not rounds:
        raise ValueError(f"no rounds in {run_dir}")
    seconds = []
    for index, r in enumerate(rounds):
        clients = max(1.0, float(r["clients"]))
        down, up = float(r["bytes_down"]), float(r["bytes_up"]) / clients
        local = float(r["round_s"])
        cold = index == 0 or local > link.rto_s
        wait = link.slow_start_s(down / clients) + link.slow_start_s(up) if cold else 0.0
        seconds.append(
            local + 2 * link.one_way_s + link.serialize_s(down) + link.serialize_s(up) + wait
        )
    return statistics.mean(seconds)


# --------------------------------------------------------------------------- faults across hosts

FAULT_ROUNDS = 3
FAULT_COMMON = [f"fed.rounds={FAULT_ROUNDS}", "fed.local_steps=15", "fed.heartbeat_s=0.5",
                "fed.heartbeat_timeout_s=15", "fed.wait_clients_s=60"]  # fmt: skip
"""A fault run's fed settings over the scenario's: rounds enough to go on after the fault, and
local training long enough (about a second) that round 2 is under way when the kill lands."""


def await_round(roles: RunningRoles, round_number: int, deadline: float) -> None:
    """Until the coordinator has checkpointed round `round_number` (1-based)."""
    latest = roles.run_dir("coordinator") / "checkpoints" / "latest.json"
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads(latest.read_text())["round"] >= round_number:
                return
        roles.check()
        time.sleep(0.05)
    raise TimeoutError(f"round {round_number} never completed")


def kill_client_mid_round(roles: RunningRoles, deadline: float) -> None:
    """client1's machine goes off as round 2 begins (round 1 checkpointed, round 2 being sent
    out or trained): the rounds from 2 on aggregate client0's update alone."""
    await_round(roles, 1, deadline)
    roles.kill("client1")


def kill_and_resume_coordinator(roles: RunningRoles, deadline: float) -> None:
    """The coordinator's machine goes off once round 1 is checkpointed; it is started again
    with `fed.resume=true` on the same host and folder, and the clients, still up, redial it."""
    await_round(roles, 1, deadline)
    roles.kill("coordinator")
    roles.start("coordinator", ["fed.resume=true"], log_suffix="-resumed")


def round_losses(run_dir: Path) -> dict[int, float]:
    """The coordinator's validation loss after each round (a resumed run's re-evaluation of the
    checkpoint it loaded counts as that round's: it must equal what was saved)."""
    return {
        int(r["step"]): float(r["val_loss"])
        for r in step_metrics(run_dir)
        if isinstance(r.get("val_loss"), int | float)
    }


def round_clients(run_dir: Path) -> list[int]:
    return [int(r["clients"]) for r in step_metrics(run_dir) if "clients" in r]


def same_rounds(hosts_dir: Path, local_dir: Path) -> tuple[bool, str]:
    """Every round's validation loss as in the reference, and as many clients in each."""
    ours, theirs = round_losses(hosts_dir), round_losses(local_dir)
    worst = max(
        (abs(ours[k] - theirs[k]) / abs(theirs[k]) for k in theirs if k in ours), default=0.0
    )
    clients = round_clients(hosts_dir)
    same = (
        sorted(ours) == sorted(theirs) == list(range(FAULT_ROUNDS + 1))
        and worst <= LOSS_RTOL
        and clients[-FAULT_ROUNDS:] == round_clients(local_dir)[-FAULT_ROUNDS:]
        and all(map(math.isfinite, ours.values()))
    )
    return same, (
        f"val loss after rounds {sorted(ours)} vs {sorted(theirs)}, "
        f"largest relative difference {worst:.1e}; clients per round {clients}"
    )


def verdict(summary: Mapping[str, Any]) -> list[str]:
    """Federated learning's answer: what the rounds did to the validation loss, and where it
    stands against training on all the data pooled (the centralized baseline)."""
    first, last = float(summary["initial_val_loss"]), float(summary["final_val_loss"])
    lines = [
        f"federated: validation loss {first:.3f} -> {last:.3f} over "
        f"{float(summary['rounds']):.0f} rounds"
        + (f", {float(summary['round_s']):.2f} s a round." if "round_s" in summary else ".")
    ]
    if "federated_over_centralized" in summary:
        ratio = float(summary["federated_over_centralized"])
        lines.append(
            f"Against centralized training on all the clients' data pooled, the same steps "
            f"({float(summary['centralized_val_loss']):.3f}): {ratio:.3f}x its loss, "
            + ("as good or better" if ratio <= 1 else f"{ratio - 1:.1%} worse")
            + ": what keeping each client's data on its own machine cost here."
        )
    else:
        lines.append("No centralized baseline ran (fed.centralized_baseline=true runs one).")
    lines.append(
        "Across real hosts a round also pays two link crossings: "
        + text(lambda: f"{curve('fed_none', delay_ms=50, rate='1gbit'):.2f} s a round at 50 ms "
               "one-way (docs/curves/fed_none.csv)")
        + "; bytes per round and compression: `python bench/fed_learn_bench.py`."
    )  # fmt: skip
    return lines


MANIFEST = Manifest(
    name=NAME,
    schema="fed_learn.config:FedLearnRunConfig",
    endpoints=("fed.coordinator",),
    renamed={"cluster.coordinator": "fed.coordinator"},
    serving=("coordinator",),
    summary="federated averaging of LoRA adapters: private data stays on each client",
    headline=Headline(
        "round_s",
        "round time (s, mean)",
        round_s,
        predict_round_s,
        means="one federated round: clients train on their own data, send their adapters, "
        "the coordinator averages them; lower is faster, final_val_loss says what it bought",
        verdict=verdict,
        benchmark=lambda: (
            f"{curve('fed_none', delay_ms=0, rate='1gbit'):.2f} s a round at 1 Gbit/s, "
            f"{curve('fed_none', delay_ms=50, rate='1gbit'):.2f} s at 50 ms one-way (three "
            "namespace hosts, debug-sized models, `python -m labtools.hosts curves`, "
            "docs/curves/fed_none.csv)"
        ),
    ),
    workload=Workload(
        (
            Metric("final_val_loss", "final validation loss", "nats/token"),
            Metric("bytes_up_per_round", "bytes up per round", "B"),
        ),
        repeat=lambda cell, repeats: [f"fed.rounds={max(1, repeats)}"],
    ),
    quick=(*DEBUG, *SHORT),
    plots=plots,
    scenario=Scenario(
        NAME,
        "fed.coordinator",
        [
            ("desktop", "coordinator", ["role=coordinator"]),
            ("laptop", "client0", ["role=client", "client_index=0"]),
            ("pc", "client1", ["role=client", "client_index=1"]),
        ],
        [*DEBUG, *TWO_CLIENTS, *SHORT, "num_threads=1"],
        same_losses("val_loss"),
        result_role="coordinator",
        port=29510,
    ),
    variants=(
        Variant("fed_none", NAME, [*DEBUG, *TWO_CLIENTS, *SHORT, "num_threads=1"]),
        Variant(
            "fed_topk_int8",
            NAME,
            [*DEBUG, *TWO_CLIENTS, *SHORT, "num_threads=1", "fed.compression=topk_int8"],
        ),
    ),
    faults={
        "client killed mid-round": Fault(
            kill_client_mid_round,
            [*FAULT_COMMON, "fed.min_fit_clients=1"],
            "same fault",
            same_rounds,
        ),
        "coordinator killed and resumed": Fault(
            kill_and_resume_coordinator, FAULT_COMMON, "uninterrupted", same_rounds
        ),
    },
)
