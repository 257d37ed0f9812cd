"""Training across slow links: DDP, PowerSGD, top-k, DiLoCo and streaming DiLoCo on three hosts.

Three worker hosts (network namespaces on this machine, root; `labtools.hosts`), one worker
each, train a model of the lab's default tiny shape with data_parallel's default per-worker
batch. The lab's trained tiny model was trained on this same corpus, and training it further
only overfits (its validation loss rises from the first step), so every method starts instead
from one stated warm start: `--warm-steps` DDP steps from random weights (model=random_long,
the default preset), whose checkpoint each run loads with dp.init_from (its data goes on where
the warm start stopped). DDP trains `--steps` steps (the token budget); the others the same
tokens a step, up to twice DDP's steps, stopping at DDP's final validation loss
(dp.target_val_loss). Each method runs across the hosts at two link settings: every link
1 Gbit/s with 0 ms (a bridge: the kernel's path), then 10 Mbit/s with 10 ms one-way (a routed
network whose forwarder delays each packet).

Printed per link: DDP's communication share of a step; per method the validation loss at equal
tokens (and its ratio to DDP's), the bytes each worker put on its link (the hosts' interface
counters), and the training time (evaluation excluded) to reach DDP's final validation loss
(the global model is evaluated every dp.eval_every steps, at DiLoCo's syncs); then what
`dp.sync=auto` picked there and that method's time against the fastest. A method that never
reaches the loss in the budget fails its row.

The losses of DDP, PowerSGD and top-k do not depend on the link (the same sums in the same
order, the same seeds; the bench checks the steps it runs at 10 Mbit/s against the 1 Gbit/s
run's), so at 10 Mbit/s, where their steps take seconds, they run only their first steps
(`--ddp-slow-steps` for DDP, `--slow-steps` for the others: past PowerSGD's start step); the
time to the step at which the 1 Gbit/s run reached DDP's loss is what those steps took plus the
rest at the median of their second half (PowerSGD's first steps are plain all-reduces), said so
in the table. DiLoCo's steps are uneven (a sync every H): it runs whole at both links.

Writes bench/results/low_comm_bench.json, the measured rows as run_matrix results and the cost
model's time-to-loss heatmaps over delay x rate for each method (data_parallel.autosync: the
step's compute measured here, the link priced by the all-reduce cost model, times each method's
steps to DDP's loss from the 1 Gbit/s runs), the two measured settings marked, under
outputs/bench/low_comm/. Last line:
`time to DDP's final validation loss at 10 Mbit/s, DDP / DiLoCo: X`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lab.machine import announce_machine, write_results
from lab.records import METRICS_FILE, read_records
from lab.registry import Scenario

RESULTS = Path(__file__).resolve().parent / "results" / "low_comm_bench.json"
OUT = Path("outputs/bench/low_comm")
HOSTS = ("desktop", "laptop", "pc")
LINKS = {"10mbit": (10.0, "10mbit"), "1gbit": (0.0, "1gbit")}
"""name -> (one-way delay ms, rate): the issue's two settings."""
DILOCO = "dp.sync=diloco"
METHODS: dict[str, list[str]] = {
    "ddp": ["dp.sync=ddp"],
    "powersgd": ["dp.sync=powersgd"],
    "topk": ["dp.sync=topk"],
    "diloco:25": [DILOCO, "dp.inner_steps=25"],
    "diloco:50": [DILOCO, "dp.inner_steps=50"],
    "diloco:50:5:8": [DILOCO, "dp.inner_steps=50", "dp.fragments=5", "dp.overlap_steps=8"],
}
"""diloco:H:P:tau is streaming DiLoCo: P fragments, each synced once every H steps at staggered
steps, its all-reduce overlapped with tau inner steps."""
AUTO_LINE = re.compile(r"dp\.sync=auto chose (\S+):")


def scenario(common: list[str]) -> Scenario:
    roles = [(host, f"worker{i}", ["role=worker", f"dp.nnodes={len(HOSTS)}", "dp.workers=1"])
             for i, host in enumerate(HOSTS)]  # fmt: skip
    return Scenario(
        "data_parallel",
        "master",
        roles,
        common,
        lambda *_: (True, ""),
        result_role="worker0",
        port=29530,  # the master's, as data_parallel's own scenario
        netproto=False,
        shared=("dp.checkpoint_dir",),
    )


def provision_model(network: Any, args: argparse.Namespace, log: Any) -> None:
    """The model every host starts from: built once in this machine's cache (the default
    preset's tokenizer takes minutes the first time) and copied to every host (weights built
    on one CPU, loaded alike everywhere)."""
    from lab.config import ModelConfig, default_cache_dir
    from lab.models import resolve_source

    cache = default_cache_dir()
    resolve_source(ModelConfig(pretrained="lab:random_long", lab_preset=args.preset),
                   cache_dir=cache)  # fmt: skip
    for host in network.hosts.values():
        shutil.copytree(cache / "tiny_models", host.cache / "tiny_models", dirs_exist_ok=True)
    print(f"models from {cache} copied to {len(network.hosts)} hosts", file=log, flush=True)


def summary_of(run_dir: Path) -> dict[str, float]:
    rows = [r for r in read_records(run_dir / METRICS_FILE) if r.get("kind") == "summary"]
    return rows[-1] if rows else {}


def evals(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, validation loss, training seconds so far) at each evaluation."""
    records = [r for r in read_records(run_dir / METRICS_FILE) if "step" in r]
    wall = {int(r["step"]): float(r["wall_s"]) for r in records if "wall_s" in r}
    return [(int(r["step"]), float(r["val_loss"]), wall.get(int(r["step"]), math.nan))
            for r in records if "val_loss" in r]  # fmt: skip


def step_losses(run_dir: Path) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in read_records(run_dir / METRICS_FILE)
            if "loss" in r and "step" in r}  # fmt: skip


def time_to(points: list[tuple[int, float, float]], target: float) -> tuple[float, int]:
    """(training seconds, step) of the first evaluation at or below `target`; (nan, 0) if none."""
    for step, val, wall in points:
        if val <= target:
            return wall, step
    return math.nan, 0


def run_method(network: Any, security: Any, out: Path, common: list[str], timeout_s: float
               ) -> tuple[Path, dict[str, int], float]:  # fmt: skip
    from labtools.hosts.scenarios import run_across

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    run_dir, crossed = run_across(network, scenario(common), security, out, timeout_s=timeout_s)
    return run_dir, crossed, time.perf_counter() - started


def auto_pick(network: Any, security: Any, out: Path, base: list[str]) -> str:
    """What dp.sync=auto chooses on this link (a two-step run: the choice is made at start)."""
    common = [*base, "dp.sync=auto", "dp.steps=2", "dp.eval_every=0"]
    run_method(network, security, out, common, 600)
    for log in sorted(out.glob("*.log")):
        found = AUTO_LINE.search(log.read_text(errors="replace"))
        if found:
            print(f"    {found.string[found.start() :].splitlines()[0]}", flush=True)
            return found.group(1)
    return "?"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from labtools.hosts.network import Network
    from labtools.hosts.scenarios import Security

    model = ["model=random_long", f"model.lab_preset={args.preset}"]
    data = [
        f"dp.max_train_blocks={args.train_blocks}",
        f"dp.eval_blocks={args.eval_blocks}",
        f"dp.eval_every={args.eval_every}",
        "dp.checkpoint_every=0",
        "num_threads=1",
    ]
    out = OUT.resolve()
    # the harness points each run's dp.checkpoint_dir at its shared folder (Scenario.shared)
    warm = out / "warm-run" / "shared" / "dp.checkpoint_dir"
    base = [*model, *data, f"dp.init_from={warm}"]
    results: dict[str, Any] = {"settings": base, "warm_steps": args.warm_steps, "links": {}}
    security = Security(secret=secrets.token_hex(16))
    target = math.nan
    for link_name in ("1gbit", "10mbit"):  # the fast link first: DDP's loss is the target
        delay, rate = LINKS[link_name]
        # 0 ms: a bridge, the kernel's own path; a delay needs the routed network, whose
        # forwarder (labtools.linkdelay) copies every packet in Python and would cap "1 Gbit/s"
        # far below it on this machine
        routed = delay if delay > 0 else None
        with Network(list(HOSTS), rate=rate, delay_ms=routed,
                     root=out / f"hosts-{link_name}") as network:  # fmt: skip
            provision_model(network, args, sys.stderr)
            if link_name == "1gbit":  # the warm start every method goes on from
                warm_common = [*model, *data, f"dp.steps={args.warm_steps}"]
                warm_dir, _, took = run_method(network, security, out / "warm-run", warm_common,
                                               1200)  # fmt: skip
                results["warm_val_loss"] = evals(warm_dir)[-1][1]
                warm_loss = results["warm_val_loss"]
                print(f"warm start: {args.warm_steps} DDP steps from random weights, validation "
                      f"loss {warm_loss:.4f} ({took:.0f} s)", flush=True)  # fmt: skip
            print(f"\n{link_name}: every link {rate}, {delay:g} ms one-way", flush=True)
            rows: dict[str, Any] = {}
            for method, settings in METHODS.items():
                short = link_name == "10mbit" and method in ("ddp", "powersgd", "topk")
                if short:
                    few = args.ddp_slow_steps if method == "ddp" else args.slow_steps
                    common = [*base, *settings, f"dp.steps={few}", "dp.eval_every=0"]
                elif method == "ddp":
                    common = [*base, *settings, f"dp.steps={args.steps}"]
                else:  # up to twice DDP's tokens, to reach DDP's final loss
                    common = [*base, *settings, f"dp.steps={2 * args.steps}",
                              f"dp.target_val_loss={target}"]  # fmt: skip
                folder = out / link_name / method.replace(":", "-")
                run_dir, crossed, took = run_method(network, security, folder, common, 1500)
                summary = summary_of(run_dir)
                rows[method] = {"run_dir": str(run_dir), "summary": summary, "crossed": crossed,
                                "evals": evals(run_dir), "short": short,
                                "losses": step_losses(run_dir), "seconds": took}  # fmt: skip
                if method == "ddp" and not short:
                    target = rows[method]["evals"][-1][1]
                print(f"  {method}: {took:.0f} s, {int(summary.get('steps', 0))} steps of "
                      f"{summary.get('step_ms', math.nan):.0f} ms", flush=True)  # fmt: skip
            pick = auto_pick(network, security, out / link_name / "auto", base)
            results["links"][link_name] = {"rows": rows, "auto": pick}
    return results


def steady_ms(run_dir: str) -> float:
    """The median step of a run's second half (past any slow start: PowerSGD's first steps
    are plain all-reduces)."""
    records = [r for r in read_records(Path(run_dir) / METRICS_FILE)
               if "step_ms" in r and "step" in r]  # fmt: skip
    ran = max(int(r["step"]) for r in records)
    return statistics.median(float(r["step_ms"]) for r in records if int(r["step"]) > ran // 2)


def extrapolated_s(run_dir: str, step: int) -> float:
    """Training seconds to `step` of a run that stopped short of it: its own steps as they
    took, the rest at its steady step (`steady_ms`)."""
    records = [r for r in read_records(Path(run_dir) / METRICS_FILE)
               if "step_ms" in r and "step" in r]  # fmt: skip
    wall = {int(r["step"]): float(r["wall_s"]) for r in records}
    ran = max(wall)
    if step <= ran:
        return wall[step]
    return wall[ran] + (step - ran) * steady_ms(run_dir) / 1e3


def at_step(points: list[tuple[int, float, float]], step: int) -> float:
    """The validation loss at `step` (equal tokens); a run that reached the target before it
    and stopped: its last (at or below the target)."""
    for at, val, _ in points:
        if at == step:
            return val
    return points[-1][1] if points and points[-1][0] < step else math.nan


def analyse(results: dict[str, Any], steps: int) -> dict[str, Any]:
    """Each link's table (times to DDP's loss, ratios, bytes) from the measured rows."""
    fast = results["links"]["1gbit"]["rows"]
    target = fast["ddp"]["evals"][-1][1]  # DDP's final validation loss (link-independent)
    ddp_bytes = statistics.fmean(fast["ddp"]["crossed"].values())
    tables: dict[str, Any] = {"target_val_loss": target}
    steps_to = {}
    for method, row in fast.items():
        _, step = time_to(row["evals"], target)
        steps_to[method] = step / steps if step else math.nan
    tables["steps_to_loss_over_ddp"] = steps_to
    for link_name, link in results["links"].items():
        rows = {}
        for method, row in link["rows"].items():
            summary = row["summary"]
            note, worst = "", math.nan
            if row["short"]:  # at 10 Mbit/s: its first steps, the rest at their median
                step = steps if method == "ddp" else time_to(fast[method]["evals"], target)[1]
                reach = extrapolated_s(row["run_dir"], step) if step else math.nan
                same = fast[method]["losses"]
                worst = max(abs(row["losses"][s] - same[s]) / abs(same[s]) for s in row["losses"])
                val = target if method == "ddp" else at_step(fast[method]["evals"], steps)
                note = (f"{len(row['losses'])} of {step} steps run, the rest at their median "
                        f"(losses within {worst:.0e} of the 1 Gbit/s run's)")  # fmt: skip
                if not step:
                    note = (f"{len(row['losses'])} steps run (losses within {worst:.0e} of the "
                            "1 Gbit/s run's, which never reached DDP's loss)")  # fmt: skip
            else:
                reach, step = time_to(row["evals"], target)
                val = at_step(row["evals"], steps)
            step_ms = float(summary.get("step_ms", math.nan))
            if row["short"]:
                step_ms = steady_ms(row["run_dir"])
            fast_bytes = statistics.fmean(fast[method]["crossed"].values())
            fast_steps = max(float(fast[method]["summary"].get("steps", steps)), 1.0)
            per_budget = fast_bytes * steps / fast_steps  # bytes for DDP's token budget
            rows[method] = {
                "val_loss": val,
                "val_ratio": val / target,
                "bytes_per_worker": per_budget,
                "bytes_ratio": per_budget / ddp_bytes,
                "step_ms": step_ms,
                "comm_share": float(summary.get("comm_share", math.nan)),
                "time_to_loss_s": reach,
                "reached_at_step": step,
                "note": note,
                "losses_vs_fast_link": worst if row["short"] else None,
            }
        fastest = min((r["time_to_loss_s"] for r in rows.values()
                       if not math.isnan(r["time_to_loss_s"])), default=math.nan)  # fmt: skip
        pick = link["auto"]
        picked = rows.get(pick, {}).get("time_to_loss_s", math.nan)
        tables[link_name] = {"rows": rows, "auto": pick, "auto_over_fastest": picked / fastest}
    return tables


def print_tables(tables: dict[str, Any]) -> None:
    for link_name in ("10mbit", "1gbit"):
        table = tables[link_name]
        rows = table["rows"]
        delay, rate = LINKS[link_name]
        print(
            f"\n{rate}, {delay:g} ms one-way: DDP's communication share of a step "
            f"{rows['ddp']['comm_share']:.0%}"
        )
        print(f"{'method':<10} {'val loss':>8} {'/ DDP':>6} {'MB/worker':>9} {'/ DDP':>6} "
              f"{'step ms':>8} {'to DDP loss':>11} {'DDP / it':>8}")  # fmt: skip
        ddp_time = rows["ddp"]["time_to_loss_s"]
        for method, r in rows.items():
            reach = r["time_to_loss_s"]
            shown = "not reached" if math.isnan(reach) else f"{reach:.0f} s"
            ratio = "" if math.isnan(reach) else f"{ddp_time / reach:.2f}"
            print(f"{method:<10} {r['val_loss']:>8.4f} {r['val_ratio']:>6.3f} "
                  f"{r['bytes_per_worker'] / 1e6:>9.1f} {r['bytes_ratio']:>6.3f} "
                  f"{r['step_ms']:>8.0f} {shown:>11} {ratio:>8} {r['note']}")  # fmt: skip
        print(
            f"auto picked {table['auto']}: its time to DDP's loss / the fastest's "
            f"{table['auto_over_fastest']:.2f}"
        )
    print(
        "\nbytes: what each host's interface sent over the whole run (1 Gbit/s runs; the "
        "same bytes at 10 Mbit/s); top-k is an all-gather, its bytes grow with the workers"
    )


def heatmaps(results: dict[str, Any], tables: dict[str, Any], steps: int) -> Path:
    """The cost model's time to DDP's final loss over delay x rate for each method, as
    run_matrix results, and one seaborn heatmap per method, the measured settings outlined
    with what they measured."""
    import numpy as np
    import seaborn as sns
    from matplotlib.patches import Rectangle

    from data_parallel.autosync import Measured, predict_step_s
    from lab.linkmodel import parse_rate
    from lab.plots import pyplot, save

    fast = results["links"]["1gbit"]["rows"]
    compute = min(float(r["summary"]["compute_ms"]) for r in fast.values()) / 1e3
    numel = float(fast["ddp"]["summary"]["comm_bytes"]) / 4
    delays, rates = [0.0, 2.0, 10.0, 50.0], ["1gbit", "100mbit", "10mbit"]
    folder = OUT.resolve() / "heatmaps"
    folder.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    methods = list(tables["10mbit"]["rows"])
    columns = 3
    rows_of = -(-len(methods) // columns)
    fig, axes = plt.subplots(rows_of, columns, figsize=(4.6 * columns, 3.4 * rows_of))
    flat = list(np.ravel(axes))
    lines = []
    for ax, method in zip(flat, methods, strict=False):
        factor = tables["steps_to_loss_over_ddp"].get(method, math.nan)
        grid = np.full((len(delays), len(rates)), math.nan)
        for i, delay in enumerate(delays):
            for j, rate in enumerate(rates):
                link = Measured(delay / 1e3, parse_rate(rate) or 1e12, compute, int(numel), 3)
                grid[i, j] = predict_step_s(method, link) * steps * factor
                lines.append({"cell": f"delay={delay:g},rate={rate}", "method": method,
                              "status": "ok" if factor == factor else "failed",
                              "metrics": {"predicted_time_to_loss_s": grid[i, j]}})  # fmt: skip
        labels = [[("never" if v != v else f"{v:.0f} s") for v in row] for row in grid]
        for name, (d, r) in LINKS.items():
            i, j = delays.index(d), rates.index(r)
            measured_s = tables[name]["rows"][method]["time_to_loss_s"]
            shown = "never" if measured_s != measured_s else f"{measured_s:.0f}"
            labels[i][j] += f"\nmeasured {shown}"
        # a method that never reached the loss: the darkest colour, and said in its cells
        shade = np.where(np.isnan(grid), 1e4, np.clip(grid, 0.1, None))
        sns.heatmap(np.log10(shade), ax=ax, annot=np.array(labels), fmt="",
                    cmap="viridis_r", vmin=0, vmax=4, cbar=False, annot_kws={"fontsize": 8},
                    xticklabels=rates, yticklabels=[f"{d:g} ms" for d in delays])  # fmt: skip
        for d, r in LINKS.values():
            i, j = delays.index(d), rates.index(r)
            ax.add_patch(Rectangle((j, i), 1, 1, fill=False, edgecolor="red", linewidth=2))
        reason = "" if factor == factor else " (never reached it at 1 Gbit/s)"
        ax.set_title(f"{method}{reason}", fontsize=10)
        ax.set_xlabel("rate")
        ax.set_ylabel("one-way delay")
    for ax in flat[len(methods) :]:
        ax.set_visible(False)
    fig.suptitle("cost model: training time to DDP's final validation loss, 3 workers "
                 "(colour: log10 s; red: measured across hosts)")  # fmt: skip
    fig.tight_layout()
    with (folder / "results.jsonl").open("w") as out:
        for line in lines:
            out.write(json.dumps(line) + "\n")
    return save(fig, plt, folder / "time_to_loss.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="DDP's steps (the token budget)")
    parser.add_argument("--warm-steps", type=int, default=300, help="the DDP warm start's steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--ddp-slow-steps",
        type=int,
        default=5,
        help="DDP's steps at 10 Mbit/s (its losses are the 1 Gbit/s run's)",
    )
    parser.add_argument(
        "--slow-steps",
        type=int,
        default=24,
        help="PowerSGD's and top-k's steps at 10 Mbit/s (their losses are the 1 Gbit/s run's)",
    )
    parser.add_argument("--quick", action="store_true", help="debug model, a smoke run")
    parser.add_argument(
        "--replot", action="store_true", help=f"only draw the heatmaps again from {RESULTS.name}"
    )
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(RESULTS.read_text())
        print(heatmaps(saved["measured"], saved["tables"], saved["steps"]))
        return
    args.preset, args.train_blocks, args.eval_blocks = "default", 16384, 64
    if args.quick:
        args.steps, args.warm_steps, args.eval_every, args.ddp_slow_steps = 20, 10, 5, 3
        args.slow_steps = 6
        args.preset, args.train_blocks, args.eval_blocks = "debug", 1024, 8
        del METHODS["diloco:25"], METHODS["diloco:50"], METHODS["diloco:50:5:8"]
        METHODS["diloco:5"] = ["dp.sync=diloco", "dp.inner_steps=5"]
        METHODS["diloco:10"] = ["dp.sync=diloco", "dp.inner_steps=10"]
        METHODS["diloco:10:2:2"] = ["dp.sync=diloco", "dp.inner_steps=10", "dp.fragments=2",
                                    "dp.overlap_steps=2"]  # fmt: skip
    from labtools.hosts.network import unavailable

    why = unavailable()
    if why:
        raise SystemExit(f"low_comm_bench needs the multi-host harness: {why}")
    machine = announce_machine()
    started = time.perf_counter()
    results = measure(args)
    tables = analyse(results, args.steps)
    print_tables(tables)
    print(
        "steps to DDP's final validation loss / DDP's steps (1 Gbit/s): "
        + ", ".join(f"{m} {v:.2f}" for m, v in tables["steps_to_loss_over_ddp"].items())
    )
    figure = heatmaps(results, tables, args.steps)
    print(f"\ncost model heatmaps: {figure}")
    minutes = (time.perf_counter() - started) / 60
    rows = tables["10mbit"]["rows"]
    ddp = rows["ddp"]["time_to_loss_s"]
    best = min((rows[m]["time_to_loss_s"] for m in rows if m.startswith("diloco")
                and not math.isnan(rows[m]["time_to_loss_s"])), default=math.nan)  # fmt: skip
    whole = min((rows[m]["time_to_loss_s"] for m in rows if m.count(":") == 1
                 and m.startswith("diloco") and not math.isnan(rows[m]["time_to_loss_s"])),
                default=math.nan)  # fmt: skip
    # the headlines are stored, so the docs' figures are read from here (lab.benchfigures):
    # the best DiLoCo, and the best without streaming
    tables["ddp_over_diloco_10mbit"] = ddp / best
    tables["ddp_over_whole_diloco_10mbit"] = ddp / whole
    # a smoke run's figures are not the bench's: they go beside the runs, not in bench/results
    where = OUT.resolve() / "quick.json" if args.quick else RESULTS
    write_results(where, {"measured": results, "tables": tables, "steps": args.steps,
                            "quick": args.quick, "minutes": minutes}, machine=machine)  # fmt: skip
    print(f"the whole bench: {minutes:.1f} min")
    ratio = "not reached" if math.isnan(best) else f"{ddp / best:.1f}"
    print(f"time to DDP's final validation loss at 10 Mbit/s, DDP / DiLoCo: {ratio}")


if __name__ == "__main__":
    main()
