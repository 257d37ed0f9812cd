"""An authenticated, encrypted overlay between a run's hosts: WireGuard, set up over netproto.

torch.distributed.rpc (TensorPipe, Gloo) was built for trusted clusters: whoever reaches its
ports reaches C++ paths that read and write files on the host (`aten::from_file`,
`aten::save`) or crash it. So a split run across hosts listens only inside this overlay.

Data plane: WireGuard (the kernel's where `ip link add type wireguard` works, else
`wireguard-go` in the foreground over TUN, owned by this process). Control plane: the hub (the
driver's host) serves netproto with the shared secret (and TLS when given); each peer sends its
public key, the hub answers every peer, once all have joined, with the roster (each peer's
public key, the address it was seen at, its overlay address). Keys are made fresh per overlay;
every peer pair also shares a preshared key derived from the secret, so a peer without the
secret completes no WireGuard handshake even if it swapped a public key on the way.

An nftables table per interface drops packets for this host's overlay address that arrive on
any other interface than the overlay's own (or loopback): Linux would otherwise accept them
from a LAN neighbour that routes the overlay subnet through this host's LAN address.

    LAB_SECRET=... python -m world.overlay up --hub --listen 192.168.1.10 --peers 1
    LAB_SECRET=... python -m world.overlay up --hub-address 192.168.1.10
Each prints its overlay address and holds the overlay until Ctrl-C or SIGTERM, then tears it
down. A split run can instead bring it up itself (`cluster.overlay.up=true`).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

from lab.launch import stop_groups
from netproto import REGISTRY, Connection, PayloadKind, Server
from netproto.errors import AuthenticationError, ConnectionClosed, NetprotoError, NetTimeout

log = logging.getLogger(__name__)

DEFAULT_SUBNET = "10.213.128.0/24"
"""The overlay's addresses: the hub .1, peers .2, .3, ... in the order they join."""
INTERFACE_PREFIX = "labwg"
"""Interface names: `labwg<pid>` by default. wireguard-go's control sockets live in
/var/run/wireguard, shared by every network namespace of a machine: names must be unique."""
INTERFACE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
"""What an interface may be called: it becomes an argument of `ip`, `wg` and `wireguard-go`
and a word of the nftables guard's text, so nothing that could read as an option or syntax."""
WG_SOCKETS = Path("/var/run/wireguard")
MAX_PEERS = 64
PSK_LABEL = b"distributed-llm-lab overlay preshared key v1"
WG_READY_S = 10.0


class OverlayError(RuntimeError):
    """The overlay could not be built (tools missing, not root, a peer or the hub failed)."""


class OverlayMsg(IntEnum):
    JOIN = 0x0311
    ROSTER = 0x0312


REGISTRY.register(
    "overlay",
    0x0310,
    0x031F,
    {OverlayMsg.JOIN: PayloadKind.JSON, OverlayMsg.ROSTER: PayloadKind.JSON},
)

# --------------------------------------------------------------------------- checks


def unavailable() -> str | None:
    """Why this machine cannot build the overlay, or None."""
    if not sys.platform.startswith("linux"):
        return f"the lab's overlay is Linux's WireGuard ({sys.platform} here)"
    if os.geteuid() != 0:
        return "bringing up a WireGuard interface needs root (CAP_NET_ADMIN)"
    for tool, package in (("wg", "wireguard-tools"), ("nft", "nftables"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install {package}"
    if shutil.which("wireguard-go") is None and not _kernel_wireguard():
        return "no WireGuard in this kernel and no wireguard-go: apt-get install wireguard-go"
    return None


_kernel_probe: list[bool] = []


def _kernel_wireguard() -> bool:
    """Whether this kernel makes WireGuard interfaces (tried once with a throwaway one)."""
    if not _kernel_probe:
        name = f"lwprobe{os.getpid() % 100000}"
        made = subprocess.run(
            ["ip", "link", "add", name, "type", "wireguard"], capture_output=True, check=False
        )
        if made.returncode == 0:
            subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        _kernel_probe.append(made.returncode == 0)
    return _kernel_probe[0]


def check_public_key(value: Any) -> str:
    """A WireGuard public key as a peer sent it: base64 of exactly 32 bytes."""
    if not isinstance(value, str) or len(value) != 44:
        raise ValueError("public_key must be 44 characters of base64")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        raise ValueError("public_key is not base64") from None
    if len(raw) != 32:
        raise ValueError("public_key must encode 32 bytes")
    return value


def preshared_key(secret: bytes) -> str:
    """The preshared key every pair of this overlay's peers uses, derived from the secret."""
    return base64.b64encode(hmac.new(secret, PSK_LABEL, hashlib.sha256).digest()).decode()


def _in_use(path: Path) -> bool:
    """Whether a process listens on the unix socket `path` (a wireguard-go's control socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:  # none there, or its owner is gone
            return False
    return True


def _run(*argv: str, stdin: str | None = None) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise OverlayError(f"`{' '.join(argv[:4])} ...` failed: {result.stderr.strip()[:300]}")
    return result.stdout.strip()


# --------------------------------------------------------------------------- the interface


@dataclass
class Peer:
    name: str
    public_key: str
    endpoint: str
    """host:port where its WireGuard listens, as the hub saw it."""
    address: str
    """Its address inside the overlay."""


@dataclass
class Interface:
    """This host's WireGuard interface: made on `up`, gone on `down`."""

    name: str = field(default_factory=lambda: f"{INTERFACE_PREFIX}{os.getpid() % 10**9}")
    private_key: str = field(default_factory=lambda: _run("wg", "genkey"), repr=False)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _guarded: bool = False
    _made: bool = False
    _rule: str = ""
    _table: str = ""
    """The routing table of what leaves from our overlay address (the lowest free one)."""

    @property
    def public_key(self) -> str:
        return _run("wg", "pubkey", stdin=self.private_key)

    def up(self) -> int:
        """Make the interface, listening on a free UDP port; returns that port. A name already
        taken, here or by a wireguard-go of another namespace, is refused: `down` would
        delete that interface, and `wg` would configure the other namespace's."""
        if not INTERFACE_NAME.fullmatch(self.name):
            raise OverlayError(
                f"interface name {self.name!r}: 1 to 15 letters, digits, '_', '.' or '-', "
                f"a letter or digit first"
            )
        if subprocess.run(["ip", "link", "show", "dev", self.name], capture_output=True,
                          check=False).returncode == 0:  # fmt: skip
            raise OverlayError(f"an interface named {self.name} exists already")
        control = WG_SOCKETS / f"{self.name}.sock"
        if _in_use(control):
            raise OverlayError(
                f"a wireguard-go serves an interface named {self.name} already ({control}, "
                f"shared by every network namespace): choose another name"
            )
        if _kernel_wireguard():
            _run("ip", "link", "add", "name", self.name, "type", "wireguard")
        else:
            control.unlink(missing_ok=True)  # a dead one's: ready means ours exists
            env = {**os.environ, "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"}
            self._proc = subprocess.Popen(
                # SIGTERM when this process dies, however it dies (SIGKILL too): no wireguard-go
                # outlives the run that started it (util-linux's setpriv, then exec)
                ["setpriv", "--pdeathsig", "TERM", "wireguard-go", "-f", self.name],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a Ctrl-C reaches us, and we tear it down in order
            )
            deadline = time.monotonic() + WG_READY_S
            while not control.exists():
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    error = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    self._made = True
                    raise OverlayError(f"wireguard-go did not start {self.name}: {error[-300:]}")
                time.sleep(0.05)
        self._made = True
        with tempfile.NamedTemporaryFile("w", prefix="wgkey-") as key:
            os.chmod(key.name, 0o600)
            key.write(self.private_key + "\n")
            key.flush()
            _run("wg", "set", self.name, "private-key", key.name, "listen-port", "0")
        return int(_run("wg", "show", self.name, "listen-port"))

    def configure(self, address: str, prefix: int, peers: list[Peer], psk: str) -> None:
        """Our overlay address, every other peer (its key, endpoint, overlay address, the
        preshared key), and the guard that keeps the LAN from reaching our overlay address.
        An address this host holds already (a roster giving us our LAN address) is refused: the
        guard would drop everything the LAN sends it, and its traffic would leave by WireGuard."""
        held = _run("ip", "-o", "addr", "show", "to", f"{address}/32")
        if held:
            raise OverlayError(
                f"the overlay address {address} is one this host holds already, on "
                f"{held.split()[1]}: the overlay would cut it off from that network"
            )
        with tempfile.NamedTemporaryFile("w", prefix="wgpsk-") as psk_file:
            os.chmod(psk_file.name, 0o600)
            psk_file.write(psk + "\n")
            psk_file.flush()
            for peer in peers:
                _run(
                    "wg",
                    "set",
                    self.name,
                    "peer",
                    peer.public_key,
                    "preshared-key",
                    psk_file.name,
                    "endpoint",
                    peer.endpoint,
                    "allowed-ips",
                    f"{peer.address}/32",
                    "persistent-keepalive",
                    "25",
                )
        _run("ip", "addr", "add", f"{address}/{prefix}", "dev", self.name)
        _run("ip", "link", "set", "dev", self.name, "up")
        # Two roles of a run on one host each have an interface on the subnet, and the main
        # table sends the subnet by one of them: a reply from the other's address would leave
        # by a WireGuard whose peers do not take that source. What leaves from our address
        # leaves by our interface.
        network = ipaddress.ip_network(f"{address}/{prefix}", strict=False)
        for _ in range(16):  # rules a process killed outright left for this address
            if subprocess.run(["ip", "rule", "del", "from", address], capture_output=True,
                              check=False).returncode != 0:  # fmt: skip
                break
        used = set(re.findall(r"lookup (\d+)", _run("ip", "rule", "show")))
        self._table = next(str(t) for t in range(20000, 30000) if str(t) not in used)
        _run("ip", "route", "add", str(network), "dev", self.name, "table", self._table)
        _run("ip", "rule", "add", "from", address, "lookup", self._table, "priority", "1000")
        self._rule = address
        self.guard(address)

    def guard(self, address: str) -> None:
        """nftables: packets for `address` are taken only from this interface or loopback."""
        table = f"lab_{self.name}"
        listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                                check=False).stdout  # fmt: skip
        for stale in re.findall(r"table inet lab_(\S+)", listed):  # of interfaces long gone
            if not Path(f"/sys/class/net/{stale}").exists():
                subprocess.run(["nft", "delete", "table", "inet", f"lab_{stale}"],
                               capture_output=True, check=False)  # fmt: skip
        rules = (
            f"table inet {table} {{\n chain input {{\n"
            f"  type filter hook input priority -10; policy accept;\n"
            f'  ip daddr {address} iifname != {{ "lo", "{self.name}" }} drop\n }}\n}}\n'
        )
        _run("nft", "-f", "-", stdin=rules)
        self._guarded = True

    def down(self) -> None:
        """Remove the guard, the interface and its wireguard-go (whatever of them exists)."""
        if self._rule:
            subprocess.run(["ip", "rule", "del", "from", self._rule, "lookup", self._table],
                           capture_output=True, check=False)  # fmt: skip
            self._rule = ""
        if self._guarded:
            subprocess.run(
                ["nft", "delete", "table", "inet", f"lab_{self.name}"],
                capture_output=True,
                check=False,
            )
            self._guarded = False
        if self._made:
            subprocess.run(["ip", "link", "del", "dev", self.name], capture_output=True,
                           check=False)  # fmt: skip
            self._made = False
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_groups([proc], grace_s=5)
            if proc.stderr is not None:
                proc.stderr.close()
            with contextlib.suppress(FileNotFoundError):
                (WG_SOCKETS / f"{self.name}.sock").unlink()


# --------------------------------------------------------------------------- control plane


@dataclass(frozen=True)
class Membership:
    """What `hub` or `join` leaves this host with."""

    interface: str
    address: str
    hub_address: str


def _check_join(payload: dict[str, Any]) -> tuple[str, str, int]:
    name, key, port = payload.get("name"), payload.get("public_key"), payload.get("wg_port")
    if not isinstance(name, str) or not 0 < len(name) <= 32 or not name.isprintable():
        raise ValueError("name must be 1 to 32 printable characters")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError("wg_port must be an integer in 1..65535")
    return name, check_public_key(key), port


def _host_of(peer: str) -> str:
    host = peer.rsplit(":", 1)[0].strip("[]")
    ipaddress.ip_address(host)  # a socket's peer name: an address, never a host name
    return host


class _Hub:
    """The hub's control server: collects `num_peers` JOINs, then answers each with the roster."""

    def __init__(
        self,
        *,
        num_peers: int,
        subnet: ipaddress.IPv4Network,
        names: frozenset[str] | None = None,
    ) -> None:
        self.num_peers = num_peers
        self.names = names
        """The peers' names when known (a split run's stage1..N): each joins once, by name, so
        a secret holder joining again under other keys cannot take the real peers' places."""
        self.hosts = list(subnet.hosts())
        self.prefix = subnet.prefixlen
        self.joined: dict[str, Peer] = {}  # by public key
        self.roster: list[Peer] | None = None
        self.hub_peer: Peer | None = None
        self.refused = 0
        self.closed = False
        self.answered: set[str] = set()
        self._done = threading.Condition()

    def session(self, conn: Connection) -> None:
        message = conn.recv(expect=OverlayMsg.JOIN)
        try:
            name, key, port = _check_join(message.payload)
            endpoint_host = _host_of(conn.peer)
        except ValueError as exc:
            self.refused += 1
            conn.send_error("bad_join", str(exc))
            return
        with self._done:
            taken = {peer.name: k for k, peer in self.joined.items()}
            if self.names is not None and (name not in self.names or taken.get(name, key) != key):
                self.refused += 1
                conn.send_error(
                    "bad_join", f"{name!r} is not a peer of this overlay, or has joined"
                )
                return
            if key not in self.joined:
                if len(self.joined) >= self.num_peers:
                    conn.send_error("full", "this overlay has all its peers")
                    return
                host = f"[{endpoint_host}]" if ":" in endpoint_host else endpoint_host
                self.joined[key] = Peer(name, key, f"{host}:{port}", "")  # address: at publish
                self._done.notify_all()
            while self.roster is None and not self.closed:
                self._done.wait(1.0)
            if self.roster is None or self.hub_peer is None:
                conn.send_error("closed", "the overlay hub gave up before every peer joined")
                return
            me = self.joined[key]
            others = [self.hub_peer, *(p for p in self.roster if p.public_key != key)]
        conn.send(
            OverlayMsg.ROSTER,
            {"address": me.address, "prefix": self.prefix, "peers": [vars(p) for p in others]},
            request_id=message.request_id,
        )
        with self._done:
            self.answered.add(key)
            self._done.notify_all()

    def wait_all(self, timeout_s: float) -> list[Peer]:
        with self._done:
            if not self._done.wait_for(lambda: len(self.joined) >= self.num_peers, timeout_s):
                raise OverlayError(
                    f"{len(self.joined)} of {self.num_peers} peers joined the overlay within "
                    f"{timeout_s:.0f}s"
                )
            # addresses by name (stage1 .2, stage2 .3, ...), not by who happened to join first
            for index, peer in enumerate(sorted(self.joined.values(), key=lambda p: p.name)):
                peer.address = str(self.hosts[1 + index])
            return list(self.joined.values())

    def wait_answered(self, timeout_s: float) -> None:
        """Until every peer has been sent the roster (then the control plane can close)."""
        with self._done:
            if not self._done.wait_for(lambda: len(self.answered) >= self.num_peers, timeout_s):
                raise OverlayError("the overlay's roster did not reach every peer")

    def close(self) -> None:
        with self._done:
            self.closed = True
            self._done.notify_all()

    def publish(self, hub_peer: Peer, peers: list[Peer]) -> None:
        with self._done:
            self.hub_peer, self.roster = hub_peer, peers
            self._done.notify_all()


@contextlib.contextmanager
def hub(
    *,
    listen: str,
    port: int,
    num_peers: int,
    secret: bytes,
    names: frozenset[str] | None = None,
    subnet: str = DEFAULT_SUBNET,
    timeout_s: float = 300.0,
    ssl_context: Any = None,
    interface: str | None = None,
) -> Iterator[Membership]:
    """Be the overlay's hub: serve its control plane on `listen:port` until `num_peers` peers
    joined, bring up our interface (the subnet's first address) with all of them, hold it for
    the block, and tear it down after."""
    if not 1 <= num_peers <= MAX_PEERS:
        raise OverlayError(f"an overlay has 1 to {MAX_PEERS} peers besides its hub")
    why = unavailable()
    if why is not None:
        raise OverlayError(why)
    net = ipaddress.ip_network(subnet)
    if not isinstance(net, ipaddress.IPv4Network) or net.num_addresses < num_peers + 3:
        raise OverlayError(f"overlay subnet {subnet} is not an IPv4 network with room")
    state = _Hub(num_peers=num_peers, subnet=net, names=names)
    wg = Interface(name=interface) if interface else Interface()
    server = Server(
        state.session,
        host=listen,
        port=port,
        secret=secret,
        ssl_context=ssl_context,
        read_timeout_s=timeout_s,
        handshake_timeout_s=30.0,
        name="overlay hub",
    )
    try:
        wg_port = wg.up()
        server.start()
        log.info("overlay hub on %s:%d, waiting for %d peers", listen, port, num_peers)
        peers = state.wait_all(timeout_s)
        host = f"[{listen}]" if ":" in listen else listen
        own = Peer("hub", wg.public_key, f"{host}:{wg_port}", str(state.hosts[0]))
        wg.configure(own.address, net.prefixlen, peers, preshared_key(secret))
        state.publish(own, peers)
        state.wait_answered(timeout_s)
        server.stop()  # the control plane is done: the run listens on nothing outside the overlay
        yield Membership(wg.name, own.address, own.address)
    finally:
        state.close()
        server.stop()
        wg.down()


@contextlib.contextmanager
def join(
    *,
    hub_address: str,
    port: int,
    secret: bytes,
    name: str,
    timeout_s: float = 300.0,
    ssl_context: Any = None,
    interface: str | None = None,
) -> Iterator[Membership]:
    """Join the overlay whose hub serves on `hub_address:port`; hold our interface for the block."""
    why = unavailable()
    if why is not None:
        raise OverlayError(why)
    wg = Interface(name=interface) if interface else Interface()
    try:
        wg_port = wg.up()
        payload = {"name": name, "public_key": wg.public_key, "wg_port": wg_port}
        deadline = time.monotonic() + timeout_s
        while True:  # the hub may not be up yet
            try:
                conn = Connection.connect(
                    hub_address,
                    port,
                    secret=secret,
                    ssl_context=ssl_context,
                    connect_timeout_s=10.0,
                    read_timeout_s=timeout_s,
                )
                break
            except AuthenticationError as exc:
                raise OverlayError(f"the overlay hub at {hub_address}:{port}: {exc}") from None
            except (ConnectionClosed, NetTimeout):
                if time.monotonic() > deadline:
                    raise OverlayError(
                        f"no overlay hub answered at {hub_address}:{port} within {timeout_s:.0f}s"
                    ) from None
                time.sleep(0.5)
        with conn:
            try:
                roster = conn.request(OverlayMsg.JOIN, payload, expect=OverlayMsg.ROSTER).payload
            except NetprotoError as exc:
                raise OverlayError(f"the overlay hub at {hub_address}:{port}: {exc}") from None
        address, prefix, peers = _check_roster(roster)
        wg.configure(address, prefix, peers, preshared_key(secret))
        yield Membership(wg.name, address, peers[0].address)
    finally:
        wg.down()


def _check_roster(roster: dict[str, Any]) -> tuple[str, int, list[Peer]]:
    """The hub's answer, field by field (the hub proved the secret, but is checked all the same)."""
    address, listed = roster.get("address"), roster.get("peers")
    if not isinstance(address, str) or not isinstance(listed, list) or not listed:
        raise OverlayError("the overlay hub's roster has no address or no peers")
    if len(listed) > MAX_PEERS:
        raise OverlayError("the overlay hub's roster lists too many peers")
    prefix = roster.get("prefix")
    if not isinstance(prefix, int) or isinstance(prefix, bool) or not 8 <= prefix <= 30:
        raise OverlayError("the overlay hub's roster has no prefix length in 8..30")
    peers = []
    try:
        ipaddress.IPv4Address(address)
        for item in listed:
            if not isinstance(item, dict):
                raise ValueError("a roster entry is not an object")
            host, _, wg_port = str(item.get("endpoint", "")).rpartition(":")
            ipaddress.ip_address(host.strip("[]"))
            if not wg_port.isdigit() or not 1 <= int(wg_port) <= 65535:
                raise ValueError("a roster endpoint has no port")
            ipaddress.IPv4Address(item.get("address"))
            peers.append(
                Peer(
                    str(item.get("name", ""))[:32],
                    check_public_key(item.get("public_key")),
                    str(item["endpoint"]),
                    str(item["address"]),
                )
            )
    except (ValueError, TypeError) as exc:
        raise OverlayError(f"the overlay hub's roster is malformed: {exc}") from None
    return address, prefix, peers


# --------------------------------------------------------------------------- command line


def _secret(path: str | None) -> bytes:
    secret = Path(path).read_text().strip() if path else os.environ.get("LAB_SECRET", "")
    if not secret:
        raise OverlayError("the overlay needs the shared secret: set LAB_SECRET or --secret-file")
    return secret.encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m world.overlay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="bring up this host's side of the overlay and hold it")
    up.add_argument("--hub", action="store_true", help="this host is the hub (the driver's)")
    up.add_argument("--listen", help="hub: the LAN address to serve the control plane on")
    up.add_argument("--peers", type=int, default=1, help="hub: how many peers will join")
    up.add_argument("--hub-address", help="peer: the hub's LAN address")
    up.add_argument("--port", type=int, default=29499, help="the control plane's TCP port")
    up.add_argument("--subnet", default=DEFAULT_SUBNET)
    up.add_argument("--interface", default=None, help="interface name (default labwg<pid>)")
    up.add_argument("--secret-file", default=None, help="else $LAB_SECRET")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        secret = _secret(args.secret_file)
        if args.hub:
            if not args.listen:
                parser.error("--hub needs --listen ADDRESS")
            held = hub(
                listen=args.listen,
                port=args.port,
                num_peers=args.peers,
                secret=secret,
                subnet=args.subnet,
                interface=args.interface,
            )
        else:
            if not args.hub_address:
                parser.error("a peer needs --hub-address ADDRESS")
            held = join(
                hub_address=args.hub_address,
                port=args.port,
                secret=secret,
                name=os.uname().nodename[:32] or "peer",
                interface=args.interface,
            )
        with held as membership:
            print(
                f"overlay up: interface {membership.interface}, address {membership.address}, "
                f"hub {membership.hub_address}",
                flush=True,
            )
            with contextlib.suppress(KeyboardInterrupt):
                while not stop.wait(1.0):
                    pass
    except (OverlayError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("overlay down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
