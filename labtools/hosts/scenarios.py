"""An experiment's roles across hosts as users type them (its manifest's scenario), the same
settings on one host's loopback, and `check`: the two compared."""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from lab import registry
from lab.launch import stop_groups
from lab.registry import RunningRoles, Scenario
from labtools.hosts.network import CLUSTER_NAME, HostsError, Network, cores_line

# --------------------------------------------------------------------------- running modules


@dataclass
class Security:
    """What every run gets: a shared secret, and for netproto modules optionally TLS."""

    secret: str
    tls: bool = False
    cert_dir: Path | None = None

    def tls_overrides(self, *, serving: bool) -> list[str]:
        if not self.tls:
            return []
        assert self.cert_dir is not None
        cert, key = self.cert_dir / "cert.pem", self.cert_dir / "key.pem"
        if serving:
            return ["cluster.tls.enabled=true", f"cluster.tls.cert={cert}",
                    f"cluster.tls.key={key}"]  # fmt: skip
        return ["cluster.tls.enabled=true", f"cluster.tls.ca={cert}"]


def make_certificate(folder: Path, address: str) -> None:
    """A self-signed certificate for `address` (openssl): what a user makes for a LAN server."""
    if shutil.which("openssl") is None:
        raise HostsError("--tls needs the openssl command")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={address}", "-addext", f"subjectAltName=IP:{address},IP:127.0.0.1",
         "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip


def write_cluster(folder: Path, address: str, ports: dict[str, int]) -> Path:
    """`<folder>/cluster/hosts.yaml`: every `cluster.*` endpoint of `ports` (dotted key ->
    port) at `address`, as a user's conf/cluster/mine.yaml would say (docs/two_machines.md,
    step 3). An endpoint in an experiment's own section is an override (`endpoint_overrides`)."""
    lines = [f"name: {CLUSTER_NAME}"]
    lines += [
        f"{key.removeprefix('cluster.')}: {{host: {address}, port: {port}}}"
        for key, port in ports.items()
        if key.startswith("cluster.")
    ]
    lines.append("read_timeout_s: 120.0")
    path = folder / "cluster" / f"{CLUSTER_NAME}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return folder


def endpoint_overrides(address: str, ports: dict[str, int]) -> list[str]:
    """The endpoints of `ports` outside `cluster` (in an experiment's own section) at
    `address`, as overrides: `fed.coordinator.host=...`, `fed.coordinator.port=...`."""
    return [
        o
        for key, port in ports.items()
        if not key.startswith("cluster.")
        for o in (f"{key}.host={address}", f"{key}.port={port}")
    ]


@dataclass
class Outcome:
    module: str
    identical: bool
    detail: str
    seconds: float
    link_bytes: dict[str, int] = field(default_factory=dict)
    """What crossed each host's link during the cross-host run."""
    run_dir: Path | None = None
    """The result role's run folder (metrics, outputs) of the cross-host run."""


def modules() -> list[str]:
    """The registered experiments that have a multi-host scenario."""
    return [name for name, m in registry.manifests().items() if m.scenario is not None]


def scenarios() -> dict[str, Scenario]:
    """Each registered experiment's scenario, on the hosts docs/two_machines.md puts its roles."""
    return {name: m.scenario for name, m in registry.manifests().items() if m.scenario is not None}


def provision(network: Network, *, log: TextIO) -> None:
    """docs/two_machines.md step 1: build the tiny models on the first host, copy them to the
    others (their weights depend on the CPU: every host must load the same files)."""
    first, *others = network.hosts.values()
    started = time.perf_counter()
    first.run([sys.executable, "-m", "lab.pretrain", "pretrain=debug"], timeout_s=600)
    for host in others:
        shutil.copytree(first.cache, host.cache, dirs_exist_ok=True)
    print(f"models built on {first.name} and copied to the others "
          f"({time.perf_counter() - started:.0f} s)", file=log)  # fmt: skip


def _raise_if_failed(procs: dict[str, subprocess.Popen]) -> dict[str, int | None]:
    """Each role's exit code (None: running); raises if one exited with an error."""
    codes = {name: proc.poll() for name, proc in procs.items()}
    failed = [name for name, code in codes.items() if code not in (None, 0)]
    if failed:
        raise HostsError(f"role {failed[0]} exited {codes[failed[0]]}")
    return codes


def _wait(procs: dict[str, subprocess.Popen], waited_for: Sequence[str], timeout_s: float) -> None:
    """Until every role in `waited_for` has exited; a role that fails ends the wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = _raise_if_failed(procs)
        if all(codes[name] == 0 for name in waited_for):
            return
        if time.monotonic() > deadline:
            raise HostsError(f"roles {waited_for} still running after {timeout_s:.0f} s")
        time.sleep(0.2)


class Roles:
    """The roles of one run as they go: started, killed, restarted (what a fault does)."""

    def __init__(
        self,
        network: Network,
        scenario: Scenario,
        security: Security,
        out: Path,
        *,
        on_host: str | None = None,
    ) -> None:
        self.network, self.scenario, self.security, self.out = network, scenario, security, out
        server = network[on_host or scenario.hosts[0]]
        # all on one host: the serving role at its loopback, as a single machine would say
        address = "127.0.0.1" if on_host else server.address
        self.conf = write_cluster(out / "conf", address, {scenario.endpoint: scenario.port})
        self.endpoint = endpoint_overrides(address, {scenario.endpoint: scenario.port})
        self.procs: dict[str, subprocess.Popen] = {}
        self.run_dirs: dict[str, Path] = {}
        self.placed = {
            role: (on_host or host, overrides) for host, role, overrides in scenario.roles
        }
        self.serving = scenario.roles[0][1]

    def start(self, role: str, extra: Sequence[str] = (), *, log_suffix: str = "") -> None:
        host_name, overrides = self.placed[role]
        host = self.network[host_name]
        self.run_dirs[role] = self.out / f"{host_name}-{role}"
        tls = self.security.tls_overrides(serving=role == self.serving)
        shared = [f"{key}={self.out / 'shared' / key}" for key in self.scenario.shared]
        argv = [sys.executable, "-m", self.scenario.module, *overrides, f"cluster={CLUSTER_NAME}",
                f"hydra.searchpath=[file://{self.conf}]", *self.endpoint, *self.scenario.common,
                *(tls if self.scenario.netproto else []), *shared, *extra,
                f"hydra.run.dir={self.run_dirs[role]}", "tracking.wandb=false"]  # fmt: skip
        self.procs[role] = host.start(
            argv, self.out / f"{host_name}-{role}{log_suffix}.log",
            env={"LAB_SECRET": self.security.secret},
        )  # fmt: skip

    def run_dir(self, role: str) -> Path:
        return self.run_dirs[role]

    def check(self) -> None:
        """HostsError if a role has failed."""
        _raise_if_failed(self.procs)

    def signal(self, role: str, signum: int, *, command: str) -> int:
        """`signum` to each of `role`'s descendants whose command line holds `command`."""

        proc = self.procs[role]
        try:
            found = [
                child
                for child in psutil.Process(proc.pid).children(recursive=True)
                if command in " ".join(child.cmdline())
            ]
        except psutil.NoSuchProcess:
            return 0
        for child in found:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signum)
        return len(found)

    def kill(self, role: str) -> None:
        """SIGKILL `role`'s processes, as a machine's power going off would (no goodbye)."""
        stop_groups([self.procs.pop(role)], grace_s=0, first=signal.SIGKILL)


Inject = Callable[[RunningRoles, float], None]
"""Run while a scenario's roles are up (given them and the deadline): kills or restarts roles."""


def run_across(
    network: Network,
    scenario: Scenario,
    security: Security,
    out: Path,
    *,
    timeout_s: float,
    on_host: str | None = None,
    fault: Inject | None = None,
) -> tuple[Path, dict[str, int]]:
    """Each role of `scenario` on its host (or all on `on_host`, through its loopback), as a user
    types it; `fault` meddles while they run. Returns the result role's run folder and the bytes
    that crossed each host's link (also in `<out>/link_bytes.json`)."""
    roles = Roles(network, scenario, security, out, on_host=on_host)
    before = {name: network[name].link_bytes() for name in scenario.hosts}
    deadline = time.monotonic() + timeout_s
    try:
        for _, role, _ in scenario.roles:
            roles.start(role)
        if fault is not None:
            fault(roles, deadline)
        # the serving role of a netproto module serves until stopped; the others finish
        finishing = [r for r in roles.procs if r != roles.serving or not scenario.netproto]
        _wait(roles.procs, finishing, max(1.0, deadline - time.monotonic()))
    finally:
        for host_name in scenario.hosts:
            network[host_name].stop()
    crossed = {name: network[name].link_bytes() - before[name] for name in scenario.hosts}
    (out / "link_bytes.json").write_text(json.dumps(crossed, indent=2))
    return roles.run_dirs[scenario.result_role], crossed


def run_loopback(network: Network, scenario: Scenario, out: Path, *, timeout_s: float) -> Path:
    """The same settings as one `role=local` run on the first host's loopback."""
    host = network[scenario.hosts[0]]
    run_dir = out / "loopback"
    argv = [sys.executable, "-m", scenario.module, *scenario.common,
            f"hydra.run.dir={run_dir}", "tracking.wandb=false"]  # fmt: skip
    proc = host.start(argv, out / "loopback.log")
    try:
        _wait({"local": proc}, ["local"], timeout_s)
    finally:
        host.stop()
    role_dir = run_dir / scenario.result_role
    return role_dir if (role_dir / "metrics.jsonl").is_file() else run_dir


def check_module(
    network: Network, scenario: Scenario, security: Security, out: Path, *, timeout_s: float
) -> Outcome:
    started = time.perf_counter()
    folder = out / scenario.module
    hosts_dir: Path | None = None
    crossed: dict[str, int] = {}
    try:
        hosts_dir, crossed = run_across(
            network, scenario, security, folder / "hosts", timeout_s=timeout_s
        )
        local_dir = run_loopback(network, scenario, folder, timeout_s=timeout_s)
        same, detail = scenario.compare(hosts_dir, local_dir)
        detail += f"; {sum(crossed.values()) / 2e6:.2f} MB crossed the links"
    except HostsError as exc:
        same, detail = False, f"failed: {exc} (logs in {folder})"
    placed = ", ".join(f"{role} on {host}" for host, role, _ in scenario.roles)
    return Outcome(
        scenario.module,
        same,
        f"{placed}: {detail}",
        time.perf_counter() - started,
        link_bytes=crossed,
        run_dir=hosts_dir,
    )


def check(
    modules: Sequence[str],
    *,
    out: Path,
    tls: bool = False,
    rate: str | None = None,
    timeout_s: float = 600.0,
    log: TextIO = sys.stdout,
    cores_per_host: int | None = None,
) -> list[Outcome]:
    """Run `modules` across hosts and on loopback; one line per module, then the total.
    `cores_per_host`: each host its own cores (Network)."""
    chosen = scenarios()
    unknown = [m for m in modules if m not in chosen]
    if unknown:
        raise ValueError(f"unknown module {unknown[0]!r}; choose from {', '.join(chosen)}")
    names = sorted(
        {h for m in modules for h in chosen[m].hosts}, key=("desktop", "laptop", "pc").index
    )
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with Network(names, rate=rate, root=out / "hosts", cores_per_host=cores_per_host) as network:
        addresses = ", ".join(f"{h.name} {h.address}" for h in network.hosts.values())
        shaped = f", each link capped at {rate}" if rate else ""
        print(f"hosts: {addresses} (network namespaces on one bridge{shaped})", file=log)
        if cores_per_host is not None:
            print(cores_line(network), file=log, flush=True)
        provision(network, log=log)
        security = Security(secret=secrets.token_hex(16), tls=tls)
        if tls:
            security.cert_dir = out / "tls"
            make_certificate(security.cert_dir, network[names[0]].address)
        for module in modules:
            outcome = check_module(network, chosen[module], security, out, timeout_s=timeout_s)
            outcomes.append(outcome)
            secured = "secret" + (", TLS" if tls and chosen[module].netproto else "")
            verdict = "identical" if outcome.identical else "DIFFERENT"
            print(f"{module:<16} {verdict:<9} ({secured}; {outcome.seconds:.0f} s) "
                  f"{outcome.detail}", file=log, flush=True)  # fmt: skip
    same = sum(o.identical for o in outcomes)
    print(f"modules identical across hosts: {same} of {len(outcomes)}", file=log, flush=True)
    return outcomes
