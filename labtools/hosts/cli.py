"""`python -m labtools.hosts`: the lab's modules across separate network hosts, on one machine
(the subcommands; the package's docstring says how)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from labtools.hosts.curves import CURVE_DELAYS_MS, CURVE_RATES, curves
from labtools.hosts.documented import _docs_main
from labtools.hosts.faults import fault_names, faults
from labtools.hosts.network import HostsError, _raise_interrupt, host_cpus, unavailable
from labtools.hosts.probe import link
from labtools.hosts.scenarios import check, modules

CORES_HELP = (
    "each host its own N cores (taskset on every process it starts; memory bandwidth and L3 "
    "stay shared: docs/hosts.md)"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m labtools.hosts", description=(__doc__ or "").splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("check", help="every module across hosts, compared with loopback")
    run.add_argument("--only", action="append", choices=modules(), help="a module (repeatable)")
    run.add_argument("--tls", action="store_true", help="TLS on the netproto modules too")
    run.add_argument("--rate", help="cap each host's link (a tc rate: 100mbit, 10mbit)")
    run.add_argument("--out", type=Path, default=Path("outputs/hosts"), help="logs and results")
    run.add_argument("--timeout-s", type=float, default=600.0, help="per module")
    run.add_argument("--cores-per-host", type=int, help=CORES_HELP)
    grid = sub.add_parser("curves", help="each module over link delay x rate, with predictions")
    grid.add_argument("--only", action="append", help="a variant (repeatable)")
    grid.add_argument("--delay-ms", type=float, nargs="+", default=list(CURVE_DELAYS_MS))
    grid.add_argument("--rate", nargs="+", default=list(CURVE_RATES))
    grid.add_argument("--repeats", type=int, default=1, help="runs per cell (the median counts)")
    grid.add_argument("--calibration-runs", type=int, default=3, help="local runs per variant")
    grid.add_argument("--out", type=Path, default=Path("outputs/hosts-curves"))
    grid.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    grid.add_argument("--cores-per-host", type=int, help=CORES_HELP)
    hurt = sub.add_parser(
        "faults", help="each registered fault (a machine lost mid-run) across hosts, vs loopback"
    )
    hurt.add_argument("--only", action="append", help="an experiment's faults (repeatable)")
    hurt.add_argument("--tls", action="store_true", help="TLS on too")
    hurt.add_argument("--out", type=Path, default=Path("outputs/hosts-faults"))
    hurt.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    probe = sub.add_parser("link", help="the emulated link: round trip and rate per setting")
    probe.add_argument("--delay-ms", type=float, nargs="+", default=[0.0, 2.0, 10.0, 50.0])
    probe.add_argument("--out", type=Path, default=Path("outputs/hosts-link"),
                       help="where link.json (the table's rows) goes")  # fmt: skip
    probe.add_argument(
        "--rate",
        nargs="+",
        default=["none", "1gbit", "100mbit", "10mbit"],
        help="tc rates; none: uncapped",
    )
    docs = sub.add_parser("docs", help="the documented two-machine commands, each on its host")
    docs.add_argument("--out", type=Path, default=Path("outputs/hosts-docs"))
    docs.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    args = parser.parse_args(argv)
    cores = getattr(args, "cores_per_host", None)
    if cores is not None:
        try:
            host_cpus(1, cores)
        except ValueError as exc:
            parser.error(str(exc))
    why = unavailable()
    if why is not None:
        print(f"labtools.hosts: skipped: {why}", file=sys.stderr)
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)
    # Ctrl-C unwinds and cleans up even where SIGINT came in ignored (a script's `cmd &`)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run_command(parser, args)
    except KeyboardInterrupt:
        print("labtools.hosts: interrupted; the namespaces are removed", file=sys.stderr)
        return 130
    except HostsError as exc:
        print(f"labtools.hosts: {exc}", file=sys.stderr)
        return 1


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The chosen subcommand; its exit status (Ctrl-C and harness errors: `main`'s)."""
    if args.command == "docs":
        return _docs_main(args.out.resolve(), args.timeout_s)
    if args.command == "curves":
        from labtools import costmodel

        known = costmodel.variants()
        names = args.only or list(known)
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"unknown variant {unknown[0]!r}; choose from {list(known)}")
        curves(names, out=args.out.resolve(), delays_ms=args.delay_ms, rates=args.rate,
               repeats=args.repeats, calibration_runs=args.calibration_runs,
               timeout_s=args.timeout_s, cores_per_host=args.cores_per_host)  # fmt: skip
        return costmodel.report(args.out.resolve(), names)
    if args.command == "faults":
        chosen = [(m, f) for m, f in fault_names() if not args.only or m in args.only]
        if not chosen:
            parser.error(f"no faults for {args.only}; experiments with faults: "
                         f"{', '.join(sorted({m for m, _ in fault_names()}))}")  # fmt: skip
        done = faults(chosen, out=args.out.resolve(), tls=args.tls, timeout_s=args.timeout_s)
        return 0 if all(o.identical for o in done) else 1
    if args.command == "link":
        rows = link(args.delay_ms, [None if r == "none" else r for r in args.rate])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "link.json").write_text(json.dumps(rows, indent=2))
        return 0
    outcomes = check(
        args.only or modules(),
        out=args.out.resolve(),
        tls=args.tls,
        rate=args.rate,
        timeout_s=args.timeout_s,
        cores_per_host=args.cores_per_host,
    )
    return 0 if all(o.identical for o in outcomes) else 1
