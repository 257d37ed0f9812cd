"""Each curve variant over delay x rate across hosts, after its calibration on loopback."""

from __future__ import annotations

import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from lab import registry
from labtools.hosts.network import HostsError, Network, cores_line
from labtools.hosts.scenarios import Security, provision, run_across, run_loopback, scenarios

CURVE_DELAYS_MS = (0.0, 2.0, 10.0, 50.0)
CURVE_RATES = ("1gbit", "100mbit", "10mbit")


def curves(
    names: Sequence[str],
    *,
    out: Path,
    delays_ms: Sequence[float] = CURVE_DELAYS_MS,
    rates: Sequence[str] = CURVE_RATES,
    repeats: int = 1,
    calibration_runs: int = 3,
    timeout_s: float = 600.0,
    log: TextIO = sys.stdout,
    cores_per_host: int | None = None,
) -> None:
    """Each variant's calibration runs (`calibration_runs` of them; each predicts, the median
    prediction counts) on one host's loopback, then its runs
    across hosts on every (delay, rate) of the grid, `repeats` per cell (the median is the
    cell's figure, (max - min) / median its spread); results in `<out>/<variant>/results.jsonl`
    (run_matrix's format: re-running skips the cells already done). `labtools.costmodel.report`
    then sets each cell beside its prediction and draws the heatmaps."""
    from labtools import costmodel, matrix

    if repeats < 1 or calibration_runs < 1:
        raise ValueError(f"repeats ({repeats}) and calibration_runs ({calibration_runs}) >= 1")
    chosen = costmodel.variants()
    out.mkdir(parents=True, exist_ok=True)
    base = scenarios()
    hosts = ["desktop", "laptop", "pc"]
    with Network(hosts, delay_ms=0, root=out / "hosts", cores_per_host=cores_per_host) as network:
        if cores_per_host is not None:
            print(cores_line(network), file=log, flush=True)
        provision(network, log=log)
        security = Security(secret=secrets.token_hex(16))
        for name in names:
            variant = chosen[name]
            scenario = replace(base[variant.module], common=variant.settings)
            headline = registry.manifest(variant.module).headline.key
            folder = out / name
            results = matrix.Results(folder)
            done = {r["cell"] for r in results.records() if r.get("status") == "ok"}
            calibration = folder / "calibration"
            if not (calibration / "done").is_file():
                network.set_link(delay_ms=0, rate=None)
                local_dirs = [
                    run_loopback(network, scenario, calibration / str(i), timeout_s=timeout_s)
                    for i in range(calibration_runs)
                ]
                (calibration / "done").write_text("\n".join(map(str, local_dirs)))
            local_dirs = [Path(line) for line in (calibration / "done").read_text().split()]
            local = [costmodel.headline(variant.module, d) for d in local_dirs]
            print(f"{name}: calibrated on one host's loopback: {headline} "
                  f"{statistics.median(local):.4g}", file=log, flush=True)  # fmt: skip
            for delay in delays_ms:
                for rate in rates:
                    cell = f"delay={delay:g},rate={rate}"
                    if cell in done:
                        continue
                    network.set_link(delay_ms=delay, rate=rate)
                    started = time.perf_counter()
                    cell_dir = folder / "cells" / cell.replace("=", "-").replace(",", "_")
                    shutil.rmtree(cell_dir, ignore_errors=True)
                    status, reason, metrics = "ok", "", {}
                    try:
                        measured, crossed = [], []
                        for i in range(repeats):
                            result_dir, link_bytes = run_across(
                                network, scenario, security, cell_dir / str(i),
                                timeout_s=timeout_s,
                            )  # fmt: skip
                            measured.append(costmodel.headline(variant.module, result_dir))
                            crossed.append(sum(link_bytes.values()) / 2e6)
                        middle = statistics.median(measured)
                        metrics = {"measured": middle, "link_mb": statistics.median(crossed)}
                        if repeats > 1:
                            metrics["measured_spread"] = (max(measured) - min(measured)) / middle
                    except (HostsError, ValueError, OSError) as exc:
                        status, reason = "error", str(exc)
                    results.append(matrix.clean_json({
                        "workload": name, "cell": cell, "status": status, "reason": reason,
                        "settings": {"delay_ms": delay, "rate": rate}, "metrics": metrics,
                        "repeats": repeats, "seconds": round(time.perf_counter() - started, 1),
                        "run_dir": str(cell_dir), "calibration": [str(d) for d in local_dirs],
                        "time": time.time(),
                    }))  # fmt: skip
                    shown = f"{metrics['measured']:.4g}" if metrics else f"failed: {reason}"
                    took = time.perf_counter() - started
                    print(f"{name} {cell}: {headline} {shown} ({took:.0f} s)",
                          file=log, flush=True)  # fmt: skip
