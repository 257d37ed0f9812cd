"""The fence around a run's listeners: only the run's own user reaches them.

Some of what a run listens on is not authenticated by the run: TensorPipe's port runs any
TorchScript builtin operator for whoever connects (`aten::from_file` reads a file, `aten::save`
writes one, 16 bytes of 0xff kill the process), and Gloo's full mesh takes any connection.
Loopback is no boundary on a shared host: every local process reaches 127.0.0.1. So a run gets
an address of its own, its roles listen only there, and a packet to that address is refused
unless a process of the run's own user sent it:

- **nftables** (root, `nft`): the run's address is a fresh one in 127/8 (added to `lo` under a
  label, `lo:f<id>`, which is how TensorPipe and Gloo are told to listen there: they pick an
  address by interface name), or the host's overlay address in a run across hosts; an output
  rule rejects packets to it from any uid but the run's (`meta skuid`). Packets the kernel sends
  on no process's behalf (a TCP reset) carry no uid and pass; a process's every packet carries
  one.
- **namespace** (not root): the run starts in a private user and network namespace (`unshare
  -rn`), whose loopback no other process of the host shares (`lab.experiment.main` re-runs the
  command there, through `LOCAL_FENCE`).

Drawn as the kernel sees one packet to the run's address::

    process (uid u) --connect(A:port)--> output hook: daddr A and skuid != run uid? --> RST
                                                     \\--> else: lo --> the role's socket

Each nftables table is `lab_fence_<id>`, its comment naming the launcher's pid and start time:
the next run on the host removes tables (and addresses) whose launcher is gone, so a SIGKILLed
launcher leaves nothing for long. One fence per run, the same for a split run's TensorPipe and
Gloo and for data_parallel's gloo and rendezvous store. An experiment hands `LOCAL_FENCE` to
its `lab.experiment.Experiment(fence=...)`: lab, a floor below, never imports it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

TABLE_PREFIX = "lab_fence_"
LABEL_PREFIX = "lo:f"
"""An address label on `lo` is at most 15 characters: `lo:f` and 8 hex digits of the run id."""
NAMESPACE_ENV = "LAB_FENCE_NAMESPACE"
"""Set in a run re-started inside its private namespace (so it does not re-start again)."""
FENCE_ENV = "LAB_FENCE"
"""`off`: no fence (a test's control arm, or a user who knows why); `namespace`: the private
namespace even where nftables could fence; unset (or anything else): nftables where it can,
else the namespace."""

Kind = Literal["nftables", "namespace", "none"]


class FenceError(RuntimeError):
    """The fence could not be put up (nft or ip failed): the run does not start unfenced."""


@dataclass(frozen=True)
class Fence:
    """What holds a run's listeners, and where they are."""

    kind: Kind
    address: str
    """Where every role of the run listens."""
    uid: int
    run_id: str = ""
    interface: str | None = None
    """The label TensorPipe and Gloo pick `address` by (nftables on loopback)."""
    table: str | None = None

    def describe(self) -> str:
        """The one start-up line saying which fence is in force."""
        if self.kind == "nftables":
            return (
                f"fence: nftables: this run listens on {self.address} only, and a packet to it "
                f"from any user but uid {self.uid} is refused (table inet {self.table})"
            )
        if self.kind == "namespace":
            return (
                f"fence: a private network namespace (unshare -rn): this run listens on "
                f"{self.address} in a loopback no other process of this host shares"
            )
        return (
            f"fence: none: this run listens on {self.address}, where every local process, "
            f"of any user, reaches TensorPipe's and Gloo's ports (run as root with nftables, "
            f"or where `unshare -rn` works, for a fence)"
        )


def nftables_unavailable() -> str | None:
    """Why this process cannot put up an nftables fence, or None when it can."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("nft", "ip"):
        if shutil.which(tool) is None:
            package = "nftables" if tool == "nft" else "iproute2"
            return f"no `{tool}` (Debian: apt-get install {package})"
    probe = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"nft cannot list tables here: {probe.stderr.strip()[:200]}"
    return None


def in_private_namespace() -> bool:
    return os.environ.get(NAMESPACE_ENV) == "1"


def disabled() -> bool:
    return os.environ.get(FENCE_ENV, "").lower() in ("off", "0", "false")


def wants_namespace() -> bool:
    """Whether a local run should re-start in a private namespace: asked for, or nftables
    cannot fence here (and it is not there already, nor the fence off)."""
    if disabled() or in_private_namespace():
        return False
    return (
        os.environ.get(FENCE_ENV, "").lower() == "namespace" or nftables_unavailable() is not None
    )


def _run(*argv: str, stdin: str | None = None) -> str:
    done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FenceError(f"{' '.join(argv[:4])}: {done.stderr.strip()[:300]}")
    return done.stdout


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (a reused pid has another)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"


def _owner_comment() -> str:
    pid = os.getpid()
    return f"pid={pid} start={_start_time(pid)} ns={_pid_namespace()}"


def _owner_alive(comment: str) -> bool:
    """Whether the launcher that wrote `comment` may still run. A launcher in another PID
    namespace (a container sharing this network namespace) cannot be looked up from here:
    taken as alive, never swept from here."""
    match = re.search(r"pid=(\d+) start=(\d+)(?: ns=(\S+))?", comment)
    if match is None:
        return False
    if match.group(3) is not None and match.group(3) != _pid_namespace():
        return True
    return _start_time(int(match.group(1))) == match.group(2)


GONE_STATES = {"06", "07"}
"""/proc/net/tcp states of a socket no process holds any more (TIME_WAIT, CLOSE)."""


def _sockets_on(address: str) -> int:
    """Sockets of this network namespace bound to `address` (IPv4) in a live state: a fence
    is never taken down under a run still listening there, whoever's launcher it was (the
    whole of 127/8 reaches lo: removing the address alone closes nothing)."""
    packed = socket.inet_aton(address)[::-1].hex().upper()  # as /proc/net lists it
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/udp"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[1].split(":")[0] == packed and fields[3] not in GONE_STATES:
                count += 1
    return count


def sweep_stale() -> list[str]:
    """Remove fences whose launcher is gone (SIGKILLed: nothing ran its teardown) and under
    which nothing is bound any more; returns the run ids removed. Addresses are listed before
    tables: a run putting up its fence meanwhile adds its table first, so an address seen here
    has its table in the later list."""
    addresses = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=False
    ).stdout
    listed = subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True, check=False
    ).stdout
    tables = re.findall(rf"table inet {TABLE_PREFIX}([0-9a-f]+)", listed)
    removed = []
    for run_id in tables:
        table = subprocess.run(
            ["nft", "list", "table", "inet", TABLE_PREFIX + run_id],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        comment = re.search(r'comment "([^"]*)"', table)
        if comment is not None and _owner_alive(comment.group(1)):
            continue
        fenced = re.search(r"ip daddr (\S+)", table)
        if fenced is not None and _sockets_on(fenced.group(1)):
            continue
        subprocess.run(
            ["nft", "delete", "table", "inet", TABLE_PREFIX + run_id],
            capture_output=True,
            check=False,
        )
        removed.append(run_id)
    # addresses whose table is gone (removed above, or the launcher died between the two)
    live = set(tables) - set(removed)
    for address, run_id in re.findall(
        rf"inet (\S+) .*{re.escape(LABEL_PREFIX)}([0-9a-f]+)", addresses
    ):
        if run_id not in live:
            subprocess.run(
                ["ip", "addr", "del", address, "dev", "lo"], capture_output=True, check=False
            )
    return removed


def _fresh_loopback_address() -> str:
    """An address in 127/8 that no interface holds: not 127.0.0.x nor Debian's 127.0.1.1."""
    held = _run("ip", "-4", "-o", "addr", "show")
    while True:
        candidate = str(ipaddress.IPv4Address((127 << 24) | secrets.randbelow(1 << 24)))
        second, _, last = (int(part) for part in candidate.split(".")[1:])
        if second == 0 or last in (0, 255) or f"inet {candidate}/" in held:
            continue
        return candidate


def _rules(table: str, address: str, uid: int, comment: str) -> str:
    family = "ip6" if ":" in address else "ip"
    return (
        f"table inet {table} {{\n"
        f'  comment "{comment}"\n'
        f"  chain output {{\n"
        f"    type filter hook output priority -10; policy accept;\n"
        f"    {family} daddr {address} meta skuid != {uid} counter reject\n"
        f"  }}\n"
        f"}}\n"
    )


@contextlib.contextmanager
def nftables_fence(address: str | None = None) -> Iterator[Fence]:
    """Root: packets to the run's address from any other uid are refused, for the block.

    `address`: the host's overlay address in a run across hosts; None on one host, where a
    fresh address in 127/8 is added to `lo` (labelled, so TensorPipe and Gloo can be pointed at
    it) and removed after. Stale fences of dead launchers are swept first."""
    why = nftables_unavailable()
    if why is not None:
        raise FenceError(f"an nftables fence needs root and nft: {why}")
    sweep_stale()
    run_id = secrets.token_hex(4)
    table, uid = TABLE_PREFIX + run_id, os.geteuid()
    label = None
    added = False
    if address is None:
        address, label = _fresh_loopback_address(), LABEL_PREFIX + run_id
    try:
        # the rule first: nothing listens on the address before it is fenced
        _run("nft", "-f", "-", stdin=_rules(table, address, uid, _owner_comment()))
        if label is not None:
            _run("ip", "addr", "add", f"{address}/32", "dev", "lo", "label", label)
            added = True
        yield Fence("nftables", address, uid, run_id=run_id, interface=label, table=table)
    finally:
        if added:
            subprocess.run(
                ["ip", "addr", "del", f"{address}/32", "dev", "lo"],
                capture_output=True,
                check=False,
            )
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True, check=False)


@contextlib.contextmanager
def loopback_fence() -> Iterator[Fence]:
    """The fence of a run on one host: nftables where this process can, the private namespace
    where the run was re-started in one (`lab.experiment.main`), none otherwise (or where
    LAB_FENCE=off), each said in one line on start-up."""
    uid = os.geteuid()
    if disabled():
        fence = Fence("none", "127.0.0.1", uid)
        log.warning("%s (LAB_FENCE=off)", fence.describe())
        yield fence
        return
    if in_private_namespace():
        fence = Fence("namespace", "127.0.0.1", uid)
        log.info("%s", fence.describe())
        yield fence
        return
    why = nftables_unavailable()
    if why is None:
        with nftables_fence() as fence:
            log.info("%s", fence.describe())
            yield fence
        return
    fence = Fence("none", "127.0.0.1", uid)
    log.warning("%s; no nftables fence: %s", fence.describe(), why)
    yield fence


def namespace_argv(argv: list[str]) -> list[str] | None:
    """The command that re-runs `argv` inside a private user and network namespace with its
    loopback up, or None where that cannot be done here (no `unshare`, or the kernel refuses
    unprivileged user namespaces)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    probe = subprocess.run(
        ["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return None
    script = 'ip link set lo up && exec "$@"'
    return ["unshare", "-rn", "sh", "-c", script, "sh", *argv]


FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_inside(argv: list[str]) -> int:
    """Run `argv` (from `namespace_argv`) to its end, marked as inside its namespace, handing
    it every Ctrl-C, SIGTERM and SIGHUP this process gets (so the run inside ends as it would
    have out here: its checkpoints named, its roles stopped); its exit status, a signal's as
    128 + the signal's number."""
    child = subprocess.Popen(argv, env={**os.environ, NAMESPACE_ENV: "1"})
    previous = {
        number: signal.signal(number, lambda number, _frame: child.send_signal(number))
        for number in FORWARDED
    }
    try:
        code = child.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return code if code >= 0 else 128 - code


class LocalFence:
    """The fence as `lab.experiment` asks for it (its `Fencing`): the loopback fence of a local
    run, and the private namespace a run re-runs in where nftables cannot fence."""

    def loopback(self) -> contextlib.AbstractContextManager[Fence]:
        return loopback_fence()

    def namespace_reason(self) -> str | None:
        if not wants_namespace():
            return None
        return nftables_unavailable() or f"{FENCE_ENV}=namespace"

    def namespace_argv(self, argv: list[str]) -> list[str] | None:
        return namespace_argv(argv)

    def run_inside(self, argv: list[str]) -> int:
        return run_inside(argv)


LOCAL_FENCE = LocalFence()
"""What a fenced experiment's `Experiment(fence=...)` holds."""
