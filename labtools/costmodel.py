"""Predict before you buy: each experiment's headline figure on a link of D ms and B Mbit/s,
from one local run, and the predictions judged against what the host harness measured.

"Latency is compute time plus transmission time." A local run (every role on one machine's
loopback) measures the compute: its headline figure, and what each step sends. A link adds, per
step, its one-way delay once for every message the step waits for in turn (a count read from
the experiment's protocol), and each transfer's bytes over the link's rate. TCP adds one thing
a user feels: after an idle spell (longer than its retransmission timeout, 200 ms at least) a
connection starts again from a 10-segment window and doubles it every round trip, so a transfer
of n bytes waits extra round trips until the window covers n or the link's bandwidth-delay
product (`lab.linkmodel.Link.slow_start_s`). Calibrated only on the local run; nothing is fitted
to the link grid it is judged on.

    python -m labtools.costmodel split_training outputs/run/... --delay-ms 10 --rate 100mbit

Each experiment's count and predictor is its own, declared in its manifest
(`Headline.predict`, lab.registry): split_inference, split_training, fed_learn and
spec_decoding say in theirs what a step waits for.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab import registry
from lab.cli import ConfigError
from lab.linkmodel import Link, parse_rate


def check_run_of(module: str, run_dir: Path) -> None:
    """ValueError when `run_dir` is (its lab_run.json says) a run of another experiment."""
    import json

    record = Path(run_dir) / "lab_run.json"
    job = json.loads(record.read_text()).get("job") if record.is_file() else None
    if job and job != module:
        raise ValueError(
            f"{run_dir} is a run of {job}, not {module}: python -m labtools.costmodel {job} "
            f"{run_dir}"
        )


def headline(module: str, run_dir: Path) -> float:
    """The headline figure of experiment `module`'s run in `run_dir`."""
    return registry.manifest(module).headline.read(Path(run_dir))


def predict(module: str, run_dir: Path, *, delay_ms: float, rate: str | None) -> float:
    """The headline figure of `module`'s local run at `run_dir` on a link of `delay_ms` one way
    and `rate` (a tc rate or None)."""
    if not math.isfinite(delay_ms) or not 0.0 <= delay_ms <= 10_000.0:
        raise ValueError(f"delay_ms must be within 0..10000, got {delay_ms}")
    link = Link(delay_ms / 1e3, parse_rate(rate))
    return registry.manifest(module).headline.predict(Path(run_dir), link)


def variants() -> dict[str, registry.Variant]:
    """Every registered experiment's curve variants, by name."""
    return {v.name: v for m in registry.manifests().values() for v in m.variants}


WITHIN = (0.85, 1.15)


def report(out: Path, names: Sequence[str], *, log: Any = None) -> int:
    """`labtools.hosts curves`' results next to what each variant's local run predicts: a table per
    variant, `<out>/<variant>/report/results.{jsonl,csv}` and heatmaps (measured, predicted,
    measured/predicted) over delay x rate. Returns 0 when every cell is within WITHIN."""
    from labtools import heatmaps, matrix

    log = log or sys.stdout
    known = variants()
    inside = total = 0
    for name in names:
        folder = out / name
        records = matrix.Results(folder).records()
        done = folder / "calibration" / "done"
        if not records or not done.is_file():
            print(f"{name}: no results under {folder}", file=log)
            continue
        module = known[name].module
        label, unit = registry.manifest(module).headline.label.rsplit(" (", 1)
        unit = unit.rstrip(")")
        calibrations = [Path(line) for line in done.read_text().split()]
        latest = {r["cell"]: r for r in records}
        rows = []
        for record in latest.values():
            settings = record["settings"]
            metrics = dict(record.get("metrics", {}))
            if record["status"] == "ok":
                delay, rate = float(settings["delay_ms"]), str(settings["rate"])
                # from each local run, the middle prediction
                predicted = statistics.median(
                    predict(module, c, delay_ms=delay, rate=rate) for c in calibrations
                )
                metrics.update(predicted=predicted,
                               measured_over_predicted=metrics["measured"] / predicted)  # fmt: skip
            rows.append({**record, "metrics": metrics})
        report_dir = folder / "report"
        if (report_dir / matrix.RESULTS_JSONL).is_file():
            (report_dir / matrix.RESULTS_JSONL).unlink()
        results = matrix.Results(report_dir)
        for row in rows:
            results.append(matrix.clean_json(row))
        delays = sorted({float(r["settings"]["delay_ms"]) for r in rows})
        rates = sorted({str(r["settings"]["rate"]) for r in rows},
                       key=lambda r: -(parse_rate(r) or math.inf))  # fmt: skip
        for row in rows:
            row["settings"] = {"delay": f"{float(row['settings']['delay_ms']):g} ms",
                               "rate": str(row["settings"]["rate"])}  # fmt: skip
        heatmaps.draw(
            rows,
            [
                registry.Metric("measured", f"{label}, measured across hosts", unit),
                registry.Metric("predicted", f"{label}, predicted from the local run", unit),
                registry.Metric(
                    "measured_over_predicted", "measured / predicted", "ratio", ratio=True
                ),
            ],
            grid={"delay": [f"{d:g} ms" for d in delays], "rate": rates},
            axes={"delay": "one-way", "rate": "tc tbf"},
            out_dir=report_dir / "heatmaps",
            title=f"{name} across three network namespaces (labtools.hosts curves)",
        )
        local = statistics.median(headline(module, c) for c in calibrations)
        print(f"\n{name}: {label} ({unit}); local run {local:.4g}; "
              "measured / predicted per cell", file=log)  # fmt: skip
        print(f"{'delay':>8} " + " ".join(f"{r:>22}" for r in rates), file=log)
        by_cell = {(r["settings"]["delay"], r["settings"]["rate"]): r for r in rows}
        for delay in delays:
            cells = []
            for rate in rates:
                row = by_cell.get((f"{delay:g} ms", rate), {"status": "not run"})
                m = row.get("metrics", {})
                if "predicted" not in m:
                    cells.append(f"{row['status']:>22}")
                    continue
                ratio = m["measured_over_predicted"]
                total += 1
                inside += WITHIN[0] <= ratio <= WITHIN[1]
                cells.append(f"{m['measured']:>7.4g} /{m['predicted']:>7.4g} ={ratio:>5.2f}")
            print(f"{delay:>5g} ms " + " ".join(cells), file=log)
    print(f"\ncells with measured / predicted within {WITHIN[0]}-{WITHIN[1]}: {inside} of {total}",
          file=log)  # fmt: skip
    return 0 if total and inside == total else 1


def main(argv: Sequence[str] | None = None) -> int:
    first_paragraph = " ".join((__doc__ or "").split("\n\n", 1)[0].split())
    parser = argparse.ArgumentParser(prog="python -m labtools.costmodel",
                                     description=first_paragraph)  # fmt: skip
    parser.add_argument("module", choices=list(registry.manifests()),
                        help="the experiment the run is of")  # fmt: skip
    parser.add_argument("run_dir", type=Path, help="a local run of it (its metrics.jsonl)")
    parser.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 2.0, 10.0, 50.0],
                        help="one-way delays, ms (default: %(default)s)")  # fmt: skip
    parser.add_argument("--rate", nargs="+", default=["1gbit", "100mbit", "10mbit"],
                        help="link rates, as tc writes them (default: %(default)s)")  # fmt: skip
    args = parser.parse_args(argv)
    label = registry.manifest(args.module).headline.label
    try:
        check_run_of(args.module, args.run_dir)
        local = headline(args.module, args.run_dir)
        rows = [
            (d, r, predict(args.module, args.run_dir, delay_ms=d, rate=r))
            for d in args.delay_ms
            for r in args.rate
        ]
    except KeyError as exc:
        print(f"error: {args.run_dir} has no {exc.args[0]!s} in its metrics: not a finished "
              f"local run of {args.module}", file=sys.stderr)  # fmt: skip
        return 2
    except (ValueError, ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.module}, {label}: {local:.4g} in the local run {args.run_dir}")
    print(f"{'one-way delay':>14} {'rate':>8} {'predicted':>10}")
    for delay, rate, value in rows:
        print(f"{delay:>11g} ms {rate:>8} {value:>10.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
