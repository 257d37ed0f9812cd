"""What the lab's tools need from data_parallel (lab.registry): its sweep, plots, headline and a
cost model of it on a link, its quick settings, its roles across hosts (the harness's scenario).

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lab.benchfigures import figure, machine
from lab.linkmodel import Link, run_steps
from lab.plots import pyplot, rising_validation, save, smoothed
from lab.records import METRICS_FILE, read_records, same_losses
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
from lab.tracking import CONFIG_FILE

NAME = "data_parallel"

EXACT_RTOL = 1e-6
"""Losses across hosts against the same run's on loopback (relative): the same global batches,
the same gradient sums (two workers add alike in either order), one thread per worker on both."""
ACROSS = ["model.lab_preset=debug", "dp.steps=10", "dp.max_train_blocks=256", "dp.eval_blocks=4",
          "dp.eval_every=5", "dp.checkpoint_every=5", "num_threads=1",
          "cluster.overlay.up=true"]  # fmt: skip
"""Both runs' settings (the loopback run: dp.workers=2 on one host, where the overlay is not
needed and not brought up). Across hosts the rendezvous and gloo meet inside the lab's overlay."""
WORKERS = [
    ("desktop", "worker0", ["role=worker", "dp.nnodes=2", "dp.workers=1"]),
    ("laptop", "worker1", ["role=worker", "dp.nnodes=2", "dp.workers=1"]),
]
"""One worker per host; the desktop holds the rendezvous (cluster.master)."""


def step_records(run_dir: Path, key: str = "loss") -> list[dict[str, Any]]:
    """The run's per-step records holding `key`, one per step: a step trained again after a
    restart (the agent went back to the last checkpoint) replaces the lost one."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in run_steps(run_dir, key):
        if "step" in record:
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def plots(run_dir: Path) -> list[Path]:
    """The training loss against tokens seen and against training time, each smoothed, and the
    validation loss where it was measured."""
    steps = step_records(run_dir)
    if not steps or not all("tokens" in r and "wall_s" in r for r in steps):
        return []
    records = read_records(run_dir / METRICS_FILE)
    val = {int(r["step"]): float(r["val_loss"]) for r in records
           if r.get("kind") == "metrics" and "val_loss" in r and "step" in r}  # fmt: skip
    at = {int(r["step"]): r for r in steps}
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
    losses = [float(r["loss"]) for r in steps]
    for ax, key, label in ((axes[0], "tokens", "tokens trained (all workers)"),
                           (axes[1], "wall_s", "training time (s)")):  # fmt: skip
        xs = [float(r[key]) for r in steps]
        ax.plot(xs, losses, alpha=0.35, lw=1, label="per step")
        if len(losses) >= 5:
            ax.plot(xs, smoothed(losses), lw=2, label="smoothed (EMA, 0.9)")
        points = [(float(at[s][key]), loss) for s, loss in sorted(val.items()) if s in at]
        if points:
            ax.plot(*zip(*points, strict=True), "o", color="black", markersize=5,
                    label="validation (held-out text)")  # fmt: skip
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss (nats/token)")
    axes[0].legend(fontsize=8)
    workers = int(steps[-1].get("workers", 1))
    fig.suptitle(f"data parallel: {workers} workers")
    remark = rising_validation(sorted(val.items()), losses)
    return [save(fig, plt, run_dir / "dp_loss.png", remark=remark)]


def step_ms(run_dir: Path) -> float:
    """The median training step, the first (warm-up) left out."""
    steps = [float(r["step_ms"]) for r in step_records(run_dir, "step_ms")][1:]
    if not steps:
        raise ValueError(f"no training steps after the first in {run_dir}")
    return statistics.median(steps)


TRACE_FILE = "comm_trace.jsonl"
"""Each step's collectives as a worker saw them: [launched, completed] ms after the step began,
and bytes; when its synchronising backward returned (data_parallel.worker writes it)."""


def trace_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A run's traced steps, the first (warm-up) left out: `role=worker`'s own, or a local
    run's agent's."""
    for path in (run_dir / TRACE_FILE, run_dir / "agent" / TRACE_FILE):
        if path.is_file():
            return read_records(path)[1:]
    return []


def allreduce_on_link_ms(nbytes: float, workers: int, link: Link) -> float:
    """What `link` adds to one gloo all-reduce of `nbytes` among `workers` (ms).

    gloo's ring (torch 2.13) takes 2(N-1) steps, a reduce-scatter then an all-gather, each
    segment sent once the receiver has said it is ready. In the harness's namespaces (2 workers,
    tests/multihost) a bucket waited 3 one-way delays a step while the link was quick, and 2
    plus its bytes' time on a slow one (its segments go out while the notices cross), so a
    bucket costs max(3, 2 + wire time) delays a step; a tensor of one element (the loss) moves
    in one chunk, one delay a step. These counts were measured for 2 workers; for more, the same
    counts per ring step are assumed."""
    steps = 2 * (workers - 1)
    share = steps / workers  # of its bytes, what each worker sends
    one_way, wire = link.one_way_s, link.serialize_s(share * nbytes)
    if nbytes < 16 * workers:  # fewer elements than the ring's segments: one chunk
        return 1e3 * (steps * one_way + wire)
    return 1e3 * max(3 * steps * one_way, 2 * steps * one_way + wire)


def predict_traced_step(row: dict[str, Any], link: Link) -> float:
    """One traced step of N workers replayed on `link`, bucket by bucket (ms).

    Each DDP bucket is launched when its gradients are ready (the trace's launch time) and
    waits for the one before it (the process group reduces them in turn). Its time on the link
    is its local time (the CPU's part: copies, the reduction) plus what the link adds to a gloo
    all-reduce (allreduce_on_link_ms). The backward returns when the last bucket is done, or the
    compute is, whichever is later; what follows it (the clip, the optimizer, the loss's
    all-reduce) takes its local time plus, for each collective, the link's."""
    workers = int(row["workers"])
    step, synced = float(row["step_ms"]), float(row["synced_ms"])
    if workers == 1:
        return step

    def on_link(nbytes: float) -> float:
        return allreduce_on_link_ms(nbytes, workers, link)

    buckets = [c for c in row["collectives"] if c[0] <= synced]
    after = [c for c in row["collectives"] if c[0] > synced]
    if not buckets:
        return step + sum(on_link(c[2]) for c in after)
    local_end = replayed_end = float("-inf")
    for launched, completed, nbytes in buckets:
        service = completed - max(launched, local_end)  # its own time, not its wait
        local_end = completed
        replayed_end = max(launched, replayed_end) + service + on_link(nbytes)
    ready = buckets[-1][0]  # the last bucket's gradients: the backward's compute is done
    waited = synced - max(ready, local_end)
    replayed_synced = max(ready, replayed_end) + waited
    return step + (replayed_synced - synced) + sum(on_link(c[2]) for c in after)


def predict_step_ms(run_dir: Path, link: Link) -> float:
    """The median step of a local DDP run (its trace, data_parallel.worker) replayed on `link`,
    bucket by bucket (predict_traced_step)."""
    config = OmegaConf.load(run_dir / CONFIG_FILE)  # what the tracker recorded of the run
    if config.dp.engine != "ddp" or config.dp.get("sync", "ddp") != "ddp":
        raise ValueError("the cost model covers dp.engine=ddp with dp.sync=ddp")
    rows = trace_rows(run_dir)
    if not rows:
        raise ValueError(f"no traced steps after the first in {run_dir} ({TRACE_FILE})")
    return statistics.median(predict_traced_step(row, link) for row in rows)


FAULT = ["dp.steps=16", "dp.max_restarts=3"]
"""A fault run's settings over the scenario's: steps enough after the step-5 checkpoint that
the kill lands mid-run."""
WORKER_PROCESS = "spawn_main"
"""What the command line of a worker the elastic agent started holds (multiprocessing's spawn),
not the agent's, nor multiprocessing's resource tracker's."""


def trained_steps(run_dir: Path) -> int:
    """The newest step a run folder's records hold (0: none yet)."""
    with contextlib.suppress(OSError, ValueError):
        return max((int(r["step"]) for r in read_records(run_dir / METRICS_FILE)
                    if "loss" in r and "step" in r), default=0)  # fmt: skip
    return 0


def kill_a_worker_mid_run(roles: RunningRoles, deadline: float) -> None:
    """The laptop's worker process is SIGKILLed after step 6 (its agent lives on): both hosts'
    agents restart their workers, which go on from the step-5 checkpoint in the shared folder."""
    while trained_steps(roles.run_dir("worker1")) < 6:
        if time.monotonic() > deadline:
            raise TimeoutError("the run never reached step 6")
        roles.check()
        time.sleep(0.002)
    if roles.signal("worker1", signal.SIGKILL, command=WORKER_PROCESS) != 1:
        raise TimeoutError("worker1's host had no single worker process to kill")


def same_steps(hosts_dir: Path, local_dir: Path) -> tuple[bool, str]:
    """Every step's loss (a step trained again after the restart replacing the lost one) within
    EXACT_RTOL of the uninterrupted run's, and the restart on record."""
    ours = {int(r["step"]): float(r["loss"]) for r in step_records(hosts_dir)}
    theirs = {int(r["step"]): float(r["loss"]) for r in step_records(local_dir)}
    restarts = [r for r in read_records(hosts_dir / METRICS_FILE) if "restart" in r]
    if not ours or sorted(ours) != sorted(theirs):
        return False, f"steps {sorted(ours)} across hosts, {sorted(theirs)} uninterrupted"
    worst = max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in theirs)
    resumed = min((int(r["step"]) for r in restarts), default=None)
    same = worst <= EXACT_RTOL and resumed is not None
    return same, (
        f"restarted from step {resumed}; {len(ours)} step losses, largest relative difference "
        f"{worst:.1e} (tolerance {EXACT_RTOL:.0e})"
    )


def verdict(summary: Mapping[str, Any]) -> list[str]:
    """Data parallelism's answer: the workers' tokens/s against one process on the same
    tokens, and where the loss stands against it (DDP equals it; the others trade loss for
    fewer bytes)."""
    workers, sync = int(summary["workers"]), str(summary.get("sync", "ddp"))
    ours = float(summary["tokens_per_s"])
    lines = [f"data_parallel: {workers} workers, sync {sync}: {ours:,.0f} tokens/s, "
             f"{float(summary['step_ms']):.1f} ms a step, "
             f"{float(summary['comm_share']):.0%} of it communication."]  # fmt: skip
    if "one_process_tokens_per_s" not in summary:
        lines.append("No one-process baseline ran (dp.baseline=true, with dp.workers above 1).")
        return lines
    ratio = float(summary["tokens_per_s_over_one_process"])
    lines.append(
        f"One process on the same global batch and steps: "
        f"{float(summary['one_process_tokens_per_s']):,.0f} tokens/s; the workers ran {ratio:.2f}x "
        + ("its rate." if ratio >= 1 else "its rate, slower: on one machine the workers share "
           "its cores and add communication; workers pay on machines of their own.")
    )  # fmt: skip
    key = "val_loss" if "one_process_val_loss" in summary else "final_loss"
    mine, theirs = float(summary[key]), float(summary[f"one_process_{key}"])
    what = "validation" if key == "val_loss" else "training"
    if sync.startswith("ddp"):
        lines.append(f"Its {what} loss {mine:.4f} against one process's {theirs:.4f}: DDP trains "
                     "exactly as one process with the whole batch, so they match.")  # fmt: skip
    else:
        lines.append(
            f"Its {what} loss {mine:.4f} against {theirs:.4f} for one process, which DDP "
            f"equals, at the same tokens: {mine / theirs:.3f}x"
            + (": as good." if mine <= theirs * 1.005 else ", higher: its workers drift apart "
               "between syncs; more steps, or syncing more often, close the gap.")
            + " It pays on a slow link, where DDP waits on every step: "
            "`python bench/low_comm_bench.py`."
        )  # fmt: skip
    return lines


UNREAD = {
    "cluster.link": "netproto's link emulator shapes netproto traffic; gloo's does not cross it",
    "cluster.tls": "gloo does not use netproto's TLS: across hosts it runs inside the overlay "
    "(cluster.overlay), whose WireGuard encrypts it",
    "cluster.connect_timeout_s": "the rendezvous waits dp.join_timeout_s",
    "cluster.read_timeout_s": "the rendezvous waits dp.join_timeout_s",
    "cluster.max_frame_mib": "only its rendezvous store speaks netproto, its frames capped by "
    "the store's own limits (world.store)",
    "cluster.min_frame_rate_kbps": "only its rendezvous store speaks netproto, with limits of its "
    "own (world.store)",
    "cluster.max_connections_per_address": "its rendezvous store takes at most 64 connections "
    "(world.store)",
}


MANIFEST = Manifest(
    name=NAME,
    schema="data_parallel.config:DataParallelRunConfig",
    endpoints=("cluster.master",),
    unread=UNREAD,
    summary="one model, every worker a replica: torch's elastic agent, DDP or FSDP2, exact",
    headline=Headline(
        "step_ms",
        "training step (ms, median)",
        step_ms,
        predict_step_ms,
        means="one optimizer step of every worker together, their gradients summed: lower is "
        "faster; comm_share says how much of it was communication",
        verdict=verdict,
        benchmark=lambda: (
            f"{figure('data_parallel_bench', 'local > 1 > step_ms'):.1f} ms a step for 2 DDP "
            f"workers, {figure('data_parallel_bench', 'local > 1 > comm_ms'):.1f} ms of it the "
            f"all-reduce (against a no-op hook), `python bench/data_parallel_bench.py`, "
            f"loopback, {machine('data_parallel_bench')}"
        ),
    ),
    workload=Workload(
        (
            Metric("final_loss", "final training loss", "nats/token"),
            Metric("step_ms", "step time", "ms"),
            Metric("tokens_per_s", "throughput", "tokens/s"),
            Metric("comm_share", "communication share of a step", "fraction"),
        ),
        repeat=lambda cell, repeats: [f"dp.steps={max(2, repeats + 1)}"],
    ),
    quick=("dp.steps=4", "dp.max_train_blocks=64", "dp.eval_blocks=4"),
    documented=("model.lab_preset=debug", "num_threads=1"),
    plots=plots,
    scenario=Scenario(
        NAME,
        "cluster.master",
        WORKERS,
        ACROSS,
        same_losses("loss", rtol=EXACT_RTOL),
        result_role="worker0",
        netproto=False,
        shared=("dp.checkpoint_dir",),
        port=29530,
    ),
    variants=(Variant(NAME, NAME, ACROSS),),
    faults={
        "worker killed mid-run": Fault(kill_a_worker_mid_run, FAULT, "uninterrupted", same_steps),
    },
    exposure=("dp.steps=300",),
    tour=(),
)
