"""Machines lost mid-run (each experiment's manifest's faults): across hosts vs a reference."""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from lab import registry
from labtools.hosts.network import HostsError, Network
from labtools.hosts.scenarios import (
    Outcome,
    Security,
    make_certificate,
    provision,
    run_across,
    run_loopback,
)


def fault_names() -> list[tuple[str, str]]:
    """Every registered (experiment, fault) pair."""
    return [(name, fault) for name, m in registry.manifests().items() for fault in m.faults]


def check_fault(
    network: Network,
    module: str,
    name: str,
    security: Security,
    out: Path,
    *,
    timeout_s: float,
) -> Outcome:
    """`module` across three hosts with its fault `name`, against its reference run."""
    manifest = registry.manifest(module)
    case = manifest.faults[name]
    assert manifest.scenario is not None, f"{module} declares faults but no scenario"
    base = manifest.scenario
    scenario = replace(base, common=[*base.common, *case.settings])
    folder = out / f"{module}-faults" / name.replace(" ", "-")
    started = time.perf_counter()
    try:
        hosts_dir, _ = run_across(
            network, scenario, security, folder / "hosts", timeout_s=timeout_s, fault=case.inject
        )
        if case.reference == "same fault":
            local_dir, _ = run_across(
                network, scenario, security, folder / "loopback", timeout_s=timeout_s,
                on_host=scenario.hosts[0], fault=case.inject,
            )  # fmt: skip
        else:
            local_dir = run_loopback(network, scenario, folder, timeout_s=timeout_s)
        same, detail = case.compare(hosts_dir, local_dir)
        detail += f" ({case.reference})"
    except (HostsError, TimeoutError) as exc:
        same, detail = False, f"failed: {exc} (logs in {folder})"
    return Outcome(f"{module}, {name}", same, detail, time.perf_counter() - started)


def faults(
    names: Sequence[tuple[str, str]] | None = None, *, out: Path, tls: bool = False,
    timeout_s: float = 600.0, log: TextIO = sys.stdout,
) -> list[Outcome]:  # fmt: skip
    """Each (experiment, fault) of `names` (every registered one by default) across three
    hosts; one line each, then the total."""
    names = fault_names() if names is None else list(names)
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with Network(["desktop", "laptop", "pc"], root=out / "hosts") as network:
        provision(network, log=log)
        security = Security(secret=secrets.token_hex(16), tls=tls)
        if tls:
            security.cert_dir = out / "tls"
            make_certificate(security.cert_dir, network["desktop"].address)
        for module, name in names:
            outcome = check_fault(network, module, name, security, out, timeout_s=timeout_s)
            outcomes.append(outcome)
            verdict = "same" if outcome.identical else "DIFFERENT"
            print(f"{outcome.module}: {verdict} ({outcome.seconds:.0f} s) {outcome.detail}",
                  file=log, flush=True)  # fmt: skip
    print(f"faults recovered as on loopback: {sum(o.identical for o in outcomes)} of "
          f"{len(outcomes)}", file=log, flush=True)  # fmt: skip
    return outcomes
