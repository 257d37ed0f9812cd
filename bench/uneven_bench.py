"""Uneven machines: one worker half as fast, with and without dp.balance=tokens.

Two workers on this machine (`python -m data_parallel`, the default tiny model), worker 1 slowed
on purpose (`dp.slow_worker=1:2`: it sleeps as long again as each micro-step took it), DDP and
DiLoCo (H=10), each run with the even cut (`dp.balance=none`) and with each worker's share set
by its measured speed (`dp.balance=tokens`), alternated; beside them the same pair with nobody
slowed. Throughput is the tokens every worker trained together over the training time (the
run's records: with DiLoCo's balance the slow worker trains fewer tokens a round, and that is
counted).

With the even cut every step waits for the slow worker: the pair runs at its pace, half the
fast pair's. Balanced, the fast worker computes the larger share, and the pair's throughput
should approach the sum of the two speeds: 1.5x the half-speed pace for a worker half as fast.

Prints the table, writes bench/results/uneven_bench.json, and ends with
`tokens/s with worker 1 half as fast, balanced / even cut: DDP X, DiLoCo Y`. `--quick`: the
debug model and fewer steps (a smoke run, not the figures).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lab.machine import announce_machine, write_results
from lab.records import METRICS_FILE, read_records

RESULTS = Path(__file__).resolve().parent / "results" / "uneven_bench.json"
RUNS = Path("outputs/bench/uneven")
SLOW = "dp.slow_worker=1:2"
CASES: dict[str, list[str]] = {
    "ddp, nobody slowed": ["dp.sync=ddp"],
    "ddp, even cut": ["dp.sync=ddp", SLOW],
    "ddp, balanced": ["dp.sync=ddp", SLOW, "dp.balance=tokens"],
    "diloco, nobody slowed": ["dp.sync=diloco", "dp.inner_steps=10"],
    "diloco, even cut": ["dp.sync=diloco", "dp.inner_steps=10", SLOW],
    "diloco, balanced": ["dp.sync=diloco", "dp.inner_steps=10", SLOW, "dp.balance=tokens"],
}


def throughput(name: str, settings: list[str]) -> dict[str, float]:
    """One run: the tokens trained over the training seconds, from its last step record."""
    run_dir = (RUNS / name.replace(", ", "-").replace(" ", "_")).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "data_parallel", "dp.workers=2", "dp.baseline=false", *settings,
            "tracking.wandb=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    steps = [r for r in read_records(run_dir / METRICS_FILE) if "wall_s" in r and "step" in r]
    first, last = steps[0], steps[-1]  # the first step (a warm-up) left out
    tokens = float(last["tokens"]) - float(first["tokens"])
    seconds = float(last["wall_s"]) - float(first["wall_s"])
    print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case, alternated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="debug model, a smoke run")
    args = parser.parse_args()
    settings = [f"dp.steps={args.steps}", "dp.eval_every=0", "dp.checkpoint_every=0"]
    if args.quick:
        settings = ["model.lab_preset=debug", "dp.steps=10", "dp.eval_every=0",
                    "dp.checkpoint_every=0", "dp.max_train_blocks=256"]  # fmt: skip
        args.repeats = 1
    machine = announce_machine()
    measured: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
    for index in range(args.repeats):  # alternated, so a slow spell of the machine hits all
        for case, extra in CASES.items():
            measured[case].append(throughput(f"{case} {index}", [*settings, *extra]))
    rows = {case: statistics.median(r["tokens_per_s"] for r in runs)
            for case, runs in measured.items()}  # fmt: skip
    print(f"\ntwo workers on this machine, worker 1 half as fast ({SLOW}); median of "
          f"{args.repeats} run(s) each, alternated")  # fmt: skip
    print(f"{'case':<24} {'tokens/s':>9} {'/ nobody slowed':>15}")
    ratios = {}
    for engine in ("ddp", "diloco"):
        fast = rows[f"{engine}, nobody slowed"]
        for case in (f"{engine}, nobody slowed", f"{engine}, even cut", f"{engine}, balanced"):
            print(f"{case:<24} {rows[case]:>9.0f} {rows[case] / fast:>15.2f}")
        ratios[engine] = rows[f"{engine}, balanced"] / rows[f"{engine}, even cut"]
    print("a worker half as fast: the even cut runs at its pace (0.5 of nobody slowed), a "
          "balanced cut at most at the two speeds' sum (0.75)")  # fmt: skip
    where = RUNS.resolve() / "quick.json" if args.quick else RESULTS
    write_results(where, {"rows": rows, "runs": measured, "settings": settings,
                          "ratios": ratios, "quick": args.quick}, machine=machine)  # fmt: skip
    print(f"tokens/s with worker 1 half as fast, balanced / even cut: DDP {ratios['ddp']:.2f}, "
          f"DiLoCo {ratios['diloco']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
