"""`python -m labtools.hosts`: the lab's modules across separate network hosts, on one machine.

Loopback hides whole classes of bugs: a server bound to 127.0.0.1, a hard-coded localhost, an
address that differs per host, a peer that advertises the wrong interface, a refused connection.
Here each host is a network namespace: a network stack of its own (its own loopback, no route to
the others' loopbacks), one interface (`eth0`) with its own address on a bridge that joins the
hosts, and its own HOME, model cache, temporary and run folders (namespaces share the filesystem;
separate HOMEs keep "the model is missing on host B" visible). A host's link can be capped with
`tc tbf` (`--rate`). Roles run as users run them, the commands of docs/two_machines.md
(`python -m <module> role=... cluster=hosts`), with a `conf/cluster/hosts.yaml` of their own
that names the hosts' addresses, a shared secret, and TLS for the netproto modules (`--tls`).

    python -m labtools.hosts check           # the four modules across hosts, each vs loopback
    python -m labtools.hosts check --tls --rate 100mbit --only spec_decoding

`check` prints one line per module and ends with `modules identical across hosts: N of M`; each
role's log, metrics and outputs are kept under `--out`. Everything the harness made (namespaces,
bridge, processes) is removed on the way out, after a failure or Ctrl-C too, and namespaces left
by a harness killed outright (SIGKILL) are removed by the next one. It needs root and iproute2;
without them it says why and does nothing.

    python -m labtools.hosts link            # the emulated link itself: round trip, TCP rate
    python -m labtools.hosts faults --tls    # fed_learn with a client, then the coordinator, killed
    python -m labtools.hosts curves          # each module over delay x rate, vs its cost model

Link delay: netem is missing on the lab's machines (and tbf's `latency` only bounds a queue), so
`Network(delay_ms=...)` makes the switch a router that sends every packet between hosts through
a TUN device, where `labtools.linkdelay` holds it for the delay: TensorPipe's traffic as well as
netproto's. What the namespaces do not model: cores (every host shares this machine's CPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import psutil

from lab import registry
from lab.records import step_metrics
from lab.registry import RunningRoles, Scenario

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "dllab"
"""Every namespace the harness makes is named `dllab<pid>-<name>`: the pid says whose it is."""
SUBNET = "10.213.0"
"""The hosts' addresses: 10.213.0.1, .2, ... on a /24 (inside the namespaces only)."""
BRIDGE = "br0"
TUN = "tun0"
ROUTE_TABLE = "100"
CLUSTER_NAME = "hosts"
NOT_INHERITED = (
    "LAB_CACHE",
    "LAB_SECRET",
    "HF_HOME",
    "XDG_CACHE_HOME",
    "TP_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
)
"""This machine's settings a host does not get: its own cache, and only the secret it is given."""
"""Training losses across hosts equal those on loopback within this relative tolerance: the
same arithmetic on the same machine, but the order in which a coordinator's updates arrive (and
are summed) may differ between runs."""


class HostsError(RuntimeError):
    """The harness could not build or run its hosts."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise HostsError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")
    return result


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces, or None when it can (it tries one)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's ({sys.platform} here)"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> list[str]:
    """Delete the namespaces of harnesses that are no longer running, and stop what still runs
    in them (a role, the delaying forwarder); returns their names."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ", 1)[0]
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One network host: a namespace with an address and folders of its own."""

    name: str
    netns: str
    address: str
    root: Path
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def cache(self) -> Path:
        """This host's model cache: the lab's default, under its own HOME."""
        return self.home / ".cache" / "distributed-llm-lab"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment its commands get: this machine's, with HOME, caches and temp moved
        to the host's own folders (nothing of the caller's cache leaks in)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in NOT_INHERITED and not k.startswith(("MASTER_", "WANDB_"))
        }
        tmp = self.root / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env.update({"HOME": str(self.home), "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"})
        env.update(extra or {})
        return env

    def start(
        self, argv: Sequence[str], log: Path, *, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """`argv` in this host's namespace, from the repository's root, its output to `log`."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv],
                cwd=ROOT,
                env=self.env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as one
            )
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout_s: float = 120.0) -> str:
        """`argv` in this host's namespace, to completion; its output (raises if it fails)."""
        result = subprocess.run(
            ["ip", "netns", "exec", self.netns, *argv],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if result.returncode != 0:
            raise HostsError(
                f"on {self.name}: `{' '.join(argv)}` exited {result.returncode}: "
                f"{(result.stdout + result.stderr)[-2000:]}"
            )
        return result.stdout

    def link_bytes(self) -> int:
        """Bytes sent and received on this host's link (`eth0`) since it was made."""
        counters = "/sys/class/net/eth0/statistics"
        text = self.run(["cat", f"{counters}/rx_bytes", f"{counters}/tx_bytes"], timeout_s=30)
        return sum(int(value) for value in text.split())

    def stop(self) -> None:
        """Stop every process started here (SIGTERM, then SIGKILL after 10 s)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Network:
    """Hosts `names` joined by a bridge, built on entering and removed on leaving.

    `rate` (a tc rate: `100mbit`, `10mbit`) caps what each host sends (tbf on its `eth0`).
    `delay_ms` (0 included) builds a routed network instead: the switch namespace routes every
    packet between hosts through a TUN device where `labtools.linkdelay` holds it `delay_ms` before
    sending it on (one-way; a round trip gains twice that), whatever protocol carries it.
    `set_link` changes both while the hosts run.
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        addresses: Sequence[str] | None = None,
        rate: str | None = None,
        delay_ms: float | None = None,
        root: Path | None = None,
    ) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"hosts need distinct names, got {list(names)}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts on one /24")
        self.addresses = list(addresses or [f"{SUBNET}.{i}" for i in range(1, len(names) + 1)])
        if (
            len(self.addresses) != len(names)
            or len({a.rsplit(".", 1)[0] for a in self.addresses}) != 1
        ):
            raise ValueError(f"one IPv4 address per host, all on one /24: {self.addresses}")
        if delay_ms is not None and not 0.0 <= delay_ms <= 10_000.0:
            raise ValueError(f"delay_ms must be within 0..10000, got {delay_ms}")
        self.names = list(names)
        self.rate = rate
        self.delay_ms = delay_ms
        self.routed = delay_ms is not None
        self._forwarder: subprocess.Popen | None = None
        self.tag = f"{PREFIX}{os.getpid()}"
        self._root_given = root
        self.root = root or Path(tempfile.mkdtemp(prefix="lab-hosts-"))
        self.switch = f"{self.tag}-switch"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self._previous_term: Any = None

    def __enter__(self) -> Network:
        why = unavailable()
        if why is not None:
            raise HostsError(why)
        remove_stale()
        # SIGTERM (a CI job cancelled, `kill`) unwinds like Ctrl-C, so __exit__ cleans up
        self._previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._build()
        except BaseException:
            self._remove()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        if self.routed:
            self._build_router()
        else:
            _ip("link", "add", BRIDGE, "type", "bridge", netns=self.switch)
            _ip("link", "set", BRIDGE, "up", netns=self.switch)
        for index, name in enumerate(self.names, start=1):
            netns = f"{self.tag}-{name}"
            _ip("netns", "add", netns)
            self._made.append(netns)
            port = f"p{index}"  # its end on the bridge, in the switch namespace
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch,
                netns=netns)  # fmt: skip
            address = self.addresses[index - 1]
            _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=netns)
            _ip("link", "set", "eth0", "up", netns=netns)
            _ip("link", "set", "lo", "up", netns=netns)
            if self.routed:
                self._route_port(port, address, netns)
            else:
                _ip("link", "set", port, "master", BRIDGE, "up", netns=self.switch)
            self._shape(netns, self.rate)
            root = self.root / name
            (root / "home").mkdir(parents=True, exist_ok=True)
            self.hosts[name] = Host(name, netns, address, root)
        if self.routed:
            self._start_forwarder()

    def _sysctl(self, *settings: str) -> None:
        for setting in settings:
            _ip("netns", "exec", self.switch, "sysctl", "-qw", setting)

    def _build_router(self) -> None:
        """The switch as a router: every packet from a host port goes through `tun0`."""
        self._sysctl("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                     "net.ipv4.conf.default.rp_filter=0")  # fmt: skip
        # an address of its own, for the ARP it sends on the ports (none of the hosts')
        subnet = self.addresses[0].rsplit(".", 1)[0]
        taken = {int(a.rsplit(".", 1)[1]) for a in self.addresses}
        own = next(i for i in range(254, 0, -1) if i not in taken)
        _ip("addr", "add", f"{subnet}.{own}/32", "dev", "lo", netns=self.switch)
        _ip("link", "set", "lo", "up", netns=self.switch)
        _ip("tuntap", "add", "dev", TUN, "mode", "tun", netns=self.switch)
        # deep enough for a window of 10 ms at 1 Gbit/s: the forwarder, not the queue, sets the pace
        _ip("link", "set", TUN, "txqueuelen", "10000", "up", netns=self.switch)
        _ip("route", "add", "default", "dev", TUN, "table", ROUTE_TABLE, netns=self.switch)

    def _route_port(self, port: str, address: str, netns: str) -> None:
        """Host port `port`: answered for the other hosts (proxy ARP), its host reached directly,
        and what comes in through it sent to the delaying TUN device."""
        _ip("link", "set", port, "up", netns=self.switch)
        self._sysctl(f"net.ipv4.conf.{port}.proxy_arp=1", f"net.ipv4.conf.{port}.rp_filter=0")
        mac = _ip("-j", "link", "show", "eth0", netns=netns).stdout
        _ip("route", "add", f"{address}/32", "dev", port, netns=self.switch)
        _ip("neigh", "replace", address, "lladdr", json.loads(mac)[0]["address"], "dev", port,
            "nud", "permanent", netns=self.switch)  # fmt: skip
        _ip("rule", "add", "iif", port, "lookup", ROUTE_TABLE, netns=self.switch)

    def _start_forwarder(self) -> None:
        assert self.delay_ms is not None
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, "-m", "labtools.linkdelay",
             "forward", "--dev", TUN, "--delay-ms", f"{self.delay_ms:g}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self._forwarder = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "attached" once packets flow, or its error and EOF
        if "attached" not in line:
            rest = proc.stdout.read() if proc.wait(timeout=30) is not None else ""
            raise HostsError(f"the delaying forwarder did not start: {(line + rest).strip()}")

    def _stop_forwarder(self) -> None:
        proc, self._forwarder = self._forwarder, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    @staticmethod
    def _shape(netns: str, rate: str | None) -> None:
        """Cap what `netns` sends at `rate` (tbf on its eth0), or uncap it (None)."""
        if rate is None:
            subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "eth0",
                            "root"], capture_output=True, check=False)  # fmt: skip
            return
        # a bucket of one millisecond at the rate (two full frames at least): a link serializes
        # what it sends; tc's customary 64 kB would let a round's adapter through at no cost
        from labtools.costmodel import parse_rate

        bits = parse_rate(rate)
        burst = max(3028, int((bits or 0) / 8 / 1000))
        shaped = subprocess.run(
            ["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", "eth0", "root",
             "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if shaped.returncode != 0:
            raise HostsError(f"tc tbf rate {rate} failed: {shaped.stderr.strip()}")

    def set_link(self, *, delay_ms: float | None = None, rate: str | None = None) -> None:
        """Every host's link from now on: `rate` (None: uncapped) and, on a routed network,
        a one-way `delay_ms` (None: unchanged)."""
        for host in self.hosts.values():
            self._shape(host.netns, rate)
        self.rate = rate
        if delay_ms is not None and delay_ms != self.delay_ms:
            if not self.routed:
                raise HostsError("link delay needs a routed network: Network(..., delay_ms=0)")
            self._stop_forwarder()
            self.delay_ms = delay_ms
            self._start_forwarder()

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for host in self.hosts.values():
            host.stop()
        self._stop_forwarder()
        for netns in reversed(self._made):
            for pid in _ip("netns", "pids", netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)  # what a role left (an overlay's daemon)
            _ip("netns", "del", netns, check=False)
        self._made.clear()
        if self._previous_term is not None:
            signal.signal(signal.SIGTERM, self._previous_term)
            self._previous_term = None
        if self._root_given is None:
            shutil.rmtree(self.root, ignore_errors=True)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def namespaces(self) -> list[str]:
        """The namespaces this network made and still holds."""
        return list(self._made)


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
    """`<folder>/cluster/hosts.yaml`: every serving role at `address`, as a user's
    conf/cluster/mine.yaml would say (docs/two_machines.md, step 3)."""
    lines = [f"name: {CLUSTER_NAME}"]
    lines += [f"{role}: {{host: {address}, port: {port}}}" for role, port in ports.items()]
    lines.append("read_timeout_s: 120.0")
    path = folder / "cluster" / f"{CLUSTER_NAME}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return folder


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


PORTS = {"coordinator": 29510, "verifier": 29520, "master": 29530}


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
        self.conf = write_cluster(
            out / "conf", address, {scenario.endpoint: PORTS[scenario.endpoint]}
        )
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
        argv = [sys.executable, "-m", self.scenario.module, *overrides, f"cluster={CLUSTER_NAME}",
                f"hydra.searchpath=[file://{self.conf}]", *self.scenario.common,
                *(tls if self.scenario.netproto else []), *extra,
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

    def kill(self, role: str) -> None:
        """SIGKILL `role`'s processes, as a machine's power going off would (no goodbye)."""
        proc = self.procs.pop(role)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
) -> list[Outcome]:
    """Run `modules` across hosts and on loopback; one line per module, then the total."""
    chosen = scenarios()
    unknown = [m for m in modules if m not in chosen]
    if unknown:
        raise ValueError(f"unknown module {unknown[0]!r}; choose from {', '.join(chosen)}")
    names = sorted(
        {h for m in modules for h in chosen[m].hosts}, key=("desktop", "laptop", "pc").index
    )
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with Network(names, rate=rate, root=out / "hosts") as network:
        addresses = ", ".join(f"{h.name} {h.address}" for h in network.hosts.values())
        shaped = f", each link capped at {rate}" if rate else ""
        print(f"hosts: {addresses} (network namespaces on one bridge{shaped})", file=log)
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


# --------------------------------------------------------------------------- exposure

OVERLAY_PREFIX = "10.213.128."
"""The lab's overlay addresses (`cluster.overlay.subnet`'s default), as the hosts hold them."""
STRANGER = "stranger"
ATTACKS = {
    "file read (aten::from_file)": "tensorpipe",
    "file write (aten::save)": "tensorpipe",
    "one-packet kill (0xff x 16)": "tensorpipe",
    "RRef memory held on a stage": "tensorpipe",
    "Gloo full-mesh port": "gloo",
    "store fill (4 MiB values)": "store",
    "store hijack (addrs/* rewritten)": "store",
}
"""Each attack of the security review on a split run, by the listener it starts at: every one
begins with a TCP connection to a port of the run (TensorPipe's, to run builtin operators or
send garbage; Gloo's; the rendezvous store's, to meet the world as a rank)."""


@dataclass
class Listener:
    host: str
    address: str
    port: int
    process: str


@dataclass
class Exposure:
    """What a split run across hosts listened on, and what a stranger on the LAN reached."""

    listeners: list[Listener]
    attempts: dict[str, list[str]]
    """Per attack: one line per try (`connected` or why not)."""
    run_ok: bool
    detail: str

    @property
    def reached(self) -> dict[str, int]:
        return {name: sum(t.startswith("connected") for t in tries)
                for name, tries in self.attempts.items()}  # fmt: skip


def listeners(host: Host) -> list[Listener]:
    """Every TCP listener in `host` (`ss -ltnp`): the host runs the run's roles only. (Not by
    process name: torch names its processes' main thread `pt_main_thread`.)"""
    text = host.run(["ss", "-ltnpH"], timeout_s=30)
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        address, _, port = fields[3].rpartition(":")
        found.append(Listener(host.name, address.strip("[]"), int(port), fields[-1]))
    return found


DIAL_ALL = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor

def dial(target):
    address, port, payload = target
    try:
        with socket.create_connection((address, port), timeout=3) as conn:
            conn.sendall(bytes.fromhex(payload))
        return "connected"
    except OSError as exc:
        return f"no connection: {exc}"

targets = json.loads(sys.argv[1])
with ThreadPoolExecutor(64) as pool:
    print(json.dumps(list(pool.map(dial, targets))))
"""
"""A stranger's tries, all at once: each (address, port, payload as hex) dialled within 3 s."""


def exposed() -> list[str]:
    """The registered experiments whose runs across hosts a stranger attacks (`exposure`)."""
    return [
        name
        for name, m in registry.manifests().items()
        if m.exposure is not None and m.scenario is not None
    ]


def probe_exposure(
    out: Path, *, module: str | None = None, timeout_s: float = 600.0, log: TextIO = sys.stdout
) -> Exposure:
    """`module` (by default the first that declares `exposure`) across three hosts inside the
    lab's overlay, with a fourth host (a stranger on the same LAN, without the secret) that
    routes the overlay's addresses through each host's LAN address and tries every attack's
    first step on every port the run listens on: its LAN address and its overlay address."""
    candidates = exposed()
    if not candidates:
        raise HostsError("no registered experiment declares an exposure run")
    manifest = registry.manifest(module or candidates[0])
    if manifest.scenario is None or manifest.exposure is None:
        raise HostsError(f"{manifest.name} declares no exposure run")
    scenario = manifest.scenario
    scenario = replace(scenario, common=[*scenario.common, *manifest.exposure])
    out.mkdir(parents=True, exist_ok=True)
    with Network(["desktop", "laptop", "pc", STRANGER], root=out / "hosts") as network:
        provision(network, log=log)
        security = Security(secret=secrets.token_hex(16))
        roles = Roles(network, scenario, security, out / "run")
        found: list[Listener] = []
        try:
            for _, role, _ in scenario.roles:
                roles.start(role)
            deadline = time.monotonic() + timeout_s
            hosts = [network[name] for name in scenario.hosts]
            while time.monotonic() < deadline:  # until every host's TensorPipe listens
                if None not in _raise_if_failed(roles.procs).values():
                    raise HostsError("the run ended before every host listened")
                found = [item for host in hosts for item in listeners(host)]
                if {item.host for item in found if item.address.startswith(OVERLAY_PREFIX)} == set(
                    scenario.hosts
                ):
                    break
                time.sleep(0.5)
            time.sleep(2.0)  # Gloo's and the channels' listeners follow TensorPipe's
            found = [item for host in hosts for item in listeners(host)]
            stranger = network[STRANGER]
            lan = {host.name: host.address for host in hosts}
            for item in found:  # the stranger routes each overlay address via its host's LAN
                if item.address.startswith(OVERLAY_PREFIX):
                    _ip("route", "replace", f"{item.address}/32", "via", lan[item.host],
                        netns=stranger.netns)  # fmt: skip
            attempts: dict[str, list[str]] = {name: [] for name in ATTACKS}
            targets: list[tuple[str, str, int, str]] = []
            for name, surface in ATTACKS.items():
                payload = (b"\xff" * 16 if "0xff" in name else b"\x00" * 16).hex()
                for item in found:
                    store = item.host == scenario.hosts[0] and item.port == PORTS[scenario.endpoint]
                    if (surface == "store") != store:
                        continue
                    for address in {item.address, lan[item.host]} - {"127.0.0.1", "::1"}:
                        targets.append((name, address, item.port, payload))
            dialled = json.loads(stranger.run(
                [sys.executable, "-c", DIAL_ALL, json.dumps([t[1:] for t in targets])],
                timeout_s=120))  # fmt: skip
            for (name, address, port, _), result in zip(targets, dialled, strict=True):
                attempts[name].append(f"{result} ({address}:{port})")
            _wait(roles.procs, list(roles.procs), max(1.0, deadline - time.monotonic()))
            steps = step_metrics(roles.run_dirs[scenario.result_role])
            run_ok, detail = bool(steps), f"{len(steps)} steps logged"
        except HostsError as exc:
            attempts = {name: [] for name in ATTACKS}
            run_ok, detail = False, f"failed: {exc} (logs in {out / 'run'})"
        finally:
            for name in scenario.hosts:
                network[name].stop()
    exposure = Exposure(found, attempts, run_ok, detail)
    (out / "exposure.json").write_text(json.dumps(
        {"listeners": [vars(item) for item in found], "attempts": attempts, "run_ok": run_ok,
         "detail": detail}, indent=2))  # fmt: skip
    return exposure


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
    with Network(["desktop", "laptop", "pc"], delay_ms=0, root=out / "hosts") as network:
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


PROBE_PORT = 29590


def measure_link(network: Network, sender: str, receiver: str) -> dict[str, float]:
    """Round trip (ms) and the rate of one 4 MiB transfer (Mbit/s) from `sender` to `receiver`,
    measured with TCP between their namespaces (labtools.linkdelay probe)."""
    server = network[receiver].start(
        [sys.executable, "-m", "labtools.linkdelay", "probe-server", "--port", str(PROBE_PORT)],
        network.root / f"probe-{receiver}.log",
    )
    try:
        text = network[sender].run(
            [sys.executable, "-m", "labtools.linkdelay", "probe",
             "--to", f"{network[receiver].address}:{PROBE_PORT}"], timeout_s=120,
        )  # fmt: skip
        server.wait(timeout=30)
    finally:
        network[receiver].stop()
    return dict(json.loads(text.strip().splitlines()[-1]))


def link(delays_ms: Sequence[float], rates: Sequence[str | None], *, log: TextIO = sys.stdout
         ) -> list[dict[str, Any]]:  # fmt: skip
    """The emulated link itself, per (delay, rate): the round trip and transfer rate TCP sees
    between two hosts, next to what was asked for."""
    rows = []
    with Network(["desktop", "laptop"], delay_ms=delays_ms[0]) as network:
        print(f"{'delay ms':>8} {'rate':>8} {'rtt ms':>8} {'(2 x delay)':>11} "
              f"{'4 MiB Mbit/s':>12}", file=log, flush=True)  # fmt: skip
        for delay in delays_ms:
            for rate in rates:
                network.set_link(delay_ms=delay, rate=rate)
                got = measure_link(network, "laptop", "desktop")
                rows.append({"delay_ms": delay, "rate": rate or "none", **got})
                print(f"{delay:>8g} {rate or 'none':>8} {got['rtt_ms']:>8.2f} {2 * delay:>11g} "
                      f"{got['mbit_s']:>12.1f}", file=log, flush=True)  # fmt: skip
    return rows


DOCUMENTED = ("docs/two_machines.md", "README.md")
"""Where the commands a user types on each machine are written (`host$ python -m ...` lines)."""
DOC_SERVER = "192.168.1.20"
"""The serving host's address in conf/cluster/two_hosts.yaml and docs/two_machines.md; the
other hosts get 192.168.1.10, .11, ... (inside the namespaces only: nothing leaves them)."""
SERVING_ROLES = ("role=verifier", "role=coordinator")
"""Roles that serve until stopped; every other documented role finishes by itself."""


@dataclass
class Documented:
    source: str
    text: str
    lines: list[tuple[str, list[str]]]
    """(host, argv) in the order written."""


def documented_runs(paths: Sequence[str] = DOCUMENTED) -> list[Documented]:
    """Each group of `host$ python -m <module> role=...` lines in `paths`: one run on several
    machines, as written (readme_check reads the same blocks)."""
    from labtools.readme_check import readme_commands

    runs = []
    for path in paths:
        for command in readme_commands(ROOT / path):
            hosts = [part.strip().split("$", 1)[0] for part in command.text.split("  &  ")]
            multi = len(set(hosts)) > 1 and all(h.isidentifier() for h in hosts)
            if multi and not command.skipped and len(hosts) == len(command.argvs):
                runs.append(
                    Documented(path, command.text, list(zip(hosts, command.argvs, strict=True)))
                )
    return runs


def run_documented(
    run: Documented, out: Path, *, rate: str | None = None, timeout_s: float = 600.0
) -> tuple[bool, str]:
    """`run`'s lines, each in its host's namespace, the serving host at the address the cluster
    file names; `cluster=mine` is conf/cluster/two_hosts.yaml copied (docs step 3)."""
    from labtools.readme_check import with_quick

    names = list(dict.fromkeys(host for host, _ in run.lines))
    others = iter(range(10, 250))
    addresses = [DOC_SERVER if name == run.lines[0][0] else f"192.168.1.{next(others)}"
                 for name in names]  # fmt: skip
    conf = out / "conf" / "cluster"
    conf.mkdir(parents=True, exist_ok=True)
    example = (ROOT / "conf" / "cluster" / "two_hosts.yaml").read_text()
    (conf / "mine.yaml").write_text(example.replace("name: two_hosts", "name: mine"))
    with Network(names, addresses=addresses, rate=rate, root=out / "hosts") as network:
        provision(network, log=io.StringIO())
        procs: dict[str, subprocess.Popen] = {}
        for index, (host, argv) in enumerate(run.lines):
            manifest = registry.find(argv[2])
            extra = [*(manifest.documented if manifest else ()), "tracking.wandb=false"]
            full = with_quick(argv, out=out / f"{index}-{host}", extra=extra)
            full.append(f"hydra.searchpath=[file://{out / 'conf'}]")
            name = f"{index}-{host}"
            procs[name] = network[host].start(
                full, out / f"{name}.log", env={"LAB_SECRET": "a-secret-both-hosts-share"}
            )
        finishing = [
            name
            for name, (_, argv) in zip(procs, run.lines, strict=True)
            if not any(role in argv for role in SERVING_ROLES)
        ]
        try:
            _wait(procs, finishing, timeout_s)
        except HostsError as exc:
            return False, f"{exc} (logs in {out})"
    where = ", ".join(f"{n} {a}" for n, a in zip(names, addresses, strict=True))
    return True, f"every role finished on its host ({where})"


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
    grid = sub.add_parser("curves", help="each module over link delay x rate, with predictions")
    grid.add_argument("--only", action="append", help="a variant (repeatable)")
    grid.add_argument("--delay-ms", type=float, nargs="+", default=list(CURVE_DELAYS_MS))
    grid.add_argument("--rate", nargs="+", default=list(CURVE_RATES))
    grid.add_argument("--repeats", type=int, default=1, help="runs per cell (the median counts)")
    grid.add_argument("--calibration-runs", type=int, default=3, help="local runs per variant")
    grid.add_argument("--out", type=Path, default=Path("outputs/hosts-curves"))
    grid.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    hurt = sub.add_parser(
        "faults", help="each registered fault (a machine lost mid-run) across hosts, vs loopback"
    )
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
               timeout_s=args.timeout_s)  # fmt: skip
        return costmodel.report(args.out.resolve(), names)
    if args.command == "faults":
        done = faults(out=args.out.resolve(), tls=args.tls, timeout_s=args.timeout_s)
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
    )
    return 0 if all(o.identical for o in outcomes) else 1


def _docs_main(out: Path, timeout_s: float) -> int:
    runs = documented_runs()
    passed = 0
    for index, run in enumerate(runs):
        ok, detail = run_documented(run, out / str(index), timeout_s=timeout_s)
        passed += ok
        print(f"{'ok' if ok else 'FAILED':<6} {run.source}: {run.text}\n       {detail}",
              flush=True)  # fmt: skip
    print(f"documented commands ok across hosts: {passed} of {len(runs)}", flush=True)
    return 0 if passed == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
