"""Data-parallel training: what communication costs a DDP step, on loopback and across hosts.

1. On this machine, for 1, 2 and 3 workers (`python -m data_parallel`, the default tiny model):
   runs with DDP's all-reduce (`dp.sync=ddp`) alternated with the same runs under a no-op
   communication hook (`dp.sync=none`: each worker keeps its own gradients). Communication is
   the difference of their median steps (the issue's definition); beside it the time with an
   all-reduce in flight (what a run reports as comm_ms, an upper bound since the backward
   overlaps it), the bytes handed to the all-reduces per worker per step (DDP's buckets and
   the loss) and the bytes a ring puts on each worker's link.
2. Across hosts (network namespaces on this machine, root): `labtools.hosts curves` runs the
   2-worker DDP scenario over one-way delay x rate (4 x 3 cells); each cell beside the cost
   model's prediction from the local calibration run (data_parallel.manifest.predict_step_ms:
   the local run's trace replayed bucket by bucket on the link). `labtools.costmodel` draws the
   heatmaps.

Prints both tables, writes bench/results/data_parallel_bench.json, and ends with
`DDP cells within 0.85-1.15 of the cost model across hosts: N of 12`. `--quick`: the debug model,
fewer steps, one pair and two cells (a smoke run, not the figures).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab.machine import announce_machine, write_results
from lab.records import METRICS_FILE, read_records

RESULTS = Path(__file__).resolve().parent / "results" / "data_parallel_bench.json"
RUNS = Path("outputs/bench/data_parallel")
VARIANT = "data_parallel"
"""Its curve variant (data_parallel.manifest): 2 workers, one per host, DDP."""


def run_local(name: str, workers: int, sync: str, settings: list[str]) -> dict[str, float]:
    """One `python -m data_parallel` run; its summary (the final table's figures)."""
    run_dir = (RUNS / name).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "data_parallel", f"dp.workers={workers}", f"dp.sync={sync}",
            "dp.baseline=false",
            *settings, "tracking.wandb=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    summary = [r for r in read_records(run_dir / METRICS_FILE) if r.get("kind") == "summary"]
    print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return summary[-1]


def local_part(pairs: int, settings: list[str]) -> list[dict[str, Any]]:
    rows = []
    for workers in (1, 2, 3):
        runs: dict[str, list[dict[str, float]]] = {"ddp": [], "none": []}
        for index in range(pairs):  # alternated, so a slow spell of the machine hits both
            for sync in ("ddp", "none"):
                runs[sync].append(run_local(f"w{workers}-{sync}-{index}", workers, sync, settings))

        def median(sync: str, key: str, runs: dict = runs) -> float:
            return statistics.median(float(r[key]) for r in runs[sync])

        step, noop = median("ddp", "step_ms"), median("none", "step_ms")
        rows.append({
            "workers": workers,
            "step_ms": step,
            "noop_step_ms": noop,
            "comm_ms": step - noop,
            "in_flight_ms": median("ddp", "comm_ms"),
            "compute_ms": noop,
            "bucket_mb": median("ddp", "comm_bytes") / 1e6,
            "wire_mb": median("ddp", "wire_bytes") / 1e6,
            "tokens_per_s": median("ddp", "tokens_per_s"),
        })  # fmt: skip
    return rows


def print_local(rows: list[dict[str, Any]], pairs: int) -> None:
    print(f"\non this machine (loopback), median of {pairs} run(s) each, alternated")
    head = (f"{'workers':>7} {'step ms':>8} {'no-op':>8} {'comm ms':>8} {'in flight':>9} "
            f"{'MB/step':>8} {'wire MB':>8} {'tokens/s':>9}")  # fmt: skip
    print(head)
    for r in rows:
        print(f"{r['workers']:>7} {r['step_ms']:>8.1f} {r['noop_step_ms']:>8.1f} "
              f"{r['comm_ms']:>8.1f} {r['in_flight_ms']:>9.1f} {r['bucket_mb']:>8.2f} "
              f"{r['wire_mb']:>8.2f} {r['tokens_per_s']:>9.0f}")  # fmt: skip
    print("comm ms = step - the same step with a no-op communication hook; in flight = the "
          "time an all-reduce was in flight (the backward overlaps it); MB/step = bytes handed "
          "to the all-reduces per worker; wire MB = what a ring sends per worker, 2(N-1)/N of "
          "them")  # fmt: skip


def hosts_part(out: Path, delays: list[float], rates: list[str]) -> tuple[int, int, str]:
    """(cells within, cells measured, why not) of the curves across hosts."""
    from labtools import costmodel
    from labtools.hosts import curves
    from labtools.hosts.network import unavailable

    why = unavailable()
    if why:
        return 0, 0, why
    curves([VARIANT], out=out, delays_ms=delays, rates=rates)
    costmodel.report(out, [VARIANT])
    rows = read_records(out / VARIANT / "report" / "results.jsonl")
    ratios = [r["metrics"]["measured_over_predicted"] for r in rows
              if "measured_over_predicted" in r.get("metrics", {})]  # fmt: skip
    low, high = costmodel.WITHIN
    return sum(low <= x <= high for x in ratios), len(delays) * len(rates), ""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="DDP / no-op run pairs per N")
    parser.add_argument("--quick", action="store_true", help="debug model, a smoke run")
    parser.add_argument("--local-only", action="store_true", help="skip the hosts part")
    args = parser.parse_args()
    machine = announce_machine()
    settings = ["dp.steps=20", "dp.eval_every=0", "dp.checkpoint_every=0"]
    delays, rates = [0.0, 2.0, 10.0, 50.0], ["1gbit", "100mbit", "10mbit"]
    pairs = args.pairs
    if args.quick:
        settings = ["model.lab_preset=debug", "dp.steps=6", "dp.eval_every=0",
                    "dp.max_train_blocks=128"]  # fmt: skip
        delays, rates, pairs = [10.0], ["1gbit", "10mbit"], 1
    rows = local_part(pairs, settings)
    print_local(rows, pairs)
    out = (RUNS / "hosts").resolve()
    if args.local_only:
        inside, total, why = 0, 0, "--local-only"
    else:
        shutil.rmtree(out, ignore_errors=True)
        inside, total, why = hosts_part(out, delays, rates)
    write_results(RESULTS, {"local": rows, "settings": settings, "pairs": pairs,
                            "hosts": {"within": inside, "cells": total, "skipped": why,
                                      "report": str(out / VARIANT / "report")}},
                  machine=machine)  # fmt: skip
    if why:
        print(f"DDP cells within 0.85-1.15 of the cost model across hosts: not measured ({why})")
        return
    print(f"DDP cells within 0.85-1.15 of the cost model across hosts: {inside} of {total}")


if __name__ == "__main__":
    main()
