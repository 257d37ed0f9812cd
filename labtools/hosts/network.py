"""The hosts: network namespaces on one bridge, their links (rate, delay), and what the
harness leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from lab.launch import stop_groups
from labtools.linkdelay import STATS_PREFIX

ROOT = Path(__file__).resolve().parents[2]
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
    cpus: tuple[int, ...] = ()
    """The cores every process this host starts runs on (`taskset`, inherited by its children);
    empty: the machine's."""

    def _argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` in this host's namespace, on its own cores where it has them."""
        pinned = ["taskset", "-c", ",".join(map(str, self.cpus))] if self.cpus else []
        return ["ip", "netns", "exec", self.netns, *pinned, *argv]

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
                self._argv(argv),
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
            self._argv(argv),
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
        stop_groups(self.procs, grace_s=10)
        self.procs.clear()


def host_cpus(hosts: int, cores_per_host: int | None) -> list[tuple[int, ...]]:
    """Each host's cores: `cores_per_host` of this process's for each, in turn, wrapping round
    when they run out; none (every core) when `cores_per_host` is None."""
    if cores_per_host is None:
        return [()] * hosts
    available = sorted(os.sched_getaffinity(0))
    if not 1 <= cores_per_host <= len(available):
        raise ValueError(
            f"--cores-per-host {cores_per_host}: this machine gives the harness "
            f"{len(available)} core(s) ({','.join(map(str, available))})"
        )
    return [
        tuple(available[(i * cores_per_host + k) % len(available)] for k in range(cores_per_host))
        for i in range(hosts)
    ]


def cores_line(network: Network) -> str:
    """Which cores each host got, and whether any are shared (the harness prints it)."""
    owners: dict[int, list[str]] = {}
    for host in network.hosts.values():
        for cpu in host.cpus:
            owners.setdefault(cpu, []).append(host.name)
    shared = sorted(cpu for cpu, names in owners.items() if len(names) > 1)
    placed = ", ".join(
        f"{h.name} {','.join(map(str, h.cpus)) or 'all'}" for h in network.hosts.values()
    )
    note = f"; cores {','.join(map(str, shared))} shared: more hosts than cores" if shared else ""
    return f"cores: {placed} (taskset; memory bandwidth and L3 still shared{note})"


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Network:
    """Hosts `names` joined by a bridge, built on entering and removed on leaving.

    `rate` (a tc rate: `100mbit`, `10mbit`) caps what each host sends (tbf on its `eth0`).
    `delay_ms` (0 included) builds a routed network instead: the switch namespace routes every
    packet between hosts through a TUN device where `labtools.linkdelay` holds it `delay_ms` before
    sending it on (one-way; a round trip gains twice that), whatever protocol carries it.
    `set_link` changes both while the hosts run.
    `cores_per_host` gives each host cores of its own (`taskset` on every process it starts):
    host i gets the i-th run of that many of this process's cores, wrapping round (and so
    sharing, said by `cores_line`) when the hosts need more cores than there are. Memory
    bandwidth and the last-level cache stay shared (docs/hosts.md).
    `realtime_forwarder` runs the delaying forwarder at real-time priority: the emulated wire
    then holds each packet its delay and no longer, however busy the hosts' cores are (at
    normal priority it waits for a core like any process, and a packet arrives that much later).
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        addresses: Sequence[str] | None = None,
        rate: str | None = None,
        delay_ms: float | None = None,
        root: Path | None = None,
        cores_per_host: int | None = None,
        realtime_forwarder: bool = False,
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
        self.cpus = host_cpus(len(names), cores_per_host)
        self.rate = rate
        self.delay_ms = delay_ms
        self.routed = delay_ms is not None
        self.realtime_forwarder = realtime_forwarder
        self._forwarder: subprocess.Popen | None = None
        self.forwarder_stats: list[dict[str, Any]] = []
        """Each stopped forwarder's count of packets and their lateness (labtools.linkdelay
        ForwardStats), with the delay it held them for."""
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
            self.hosts[name] = Host(name, netns, address, root, cpus=self.cpus[index - 1])
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
             "forward", "--dev", TUN, "--delay-ms", f"{self.delay_ms:g}",
             *(["--realtime"] if self.realtime_forwarder else [])],
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
        stop_groups([proc], grace_s=10)
        if proc.stdout is not None:
            said = proc.stdout.read() if proc.poll() is not None else ""
            proc.stdout.close()
            for line in said.splitlines():
                if line.startswith(STATS_PREFIX):
                    try:  # a garbled line loses the counts, never the namespaces' removal
                        stats = json.loads(line[len(STATS_PREFIX) :])
                    except json.JSONDecodeError:
                        continue
                    self.forwarder_stats.append({"delay_ms": self.delay_ms, **stats})

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

    def reset_forwarder(self) -> dict[str, Any] | None:
        """Start the delaying forwarder afresh (the same delay); what the stopped one counted
        (`forwarder_stats`' last record), None where it said nothing."""
        if not self.routed:
            raise HostsError("no forwarder on a bridged network: Network(..., delay_ms=0)")
        known = len(self.forwarder_stats)
        self._stop_forwarder()
        self._start_forwarder()
        return self.forwarder_stats[-1] if len(self.forwarder_stats) > known else None

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
