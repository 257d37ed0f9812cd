"""A stranger on the LAN, without the secret, against every port a run across hosts opens."""

from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from lab import registry
from lab.records import step_metrics
from labtools.hosts.network import Host, HostsError, Network, _ip
from labtools.hosts.scenarios import Roles, Security, _raise_if_failed, _wait, provision

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
    local: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per host: what another local user reached of the run's overlay listeners, with the
    controls (`dial_as_local_user`)."""

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


LOCAL_DIAL = """
import json, os, socket, subprocess, sys

def dial(target):
    try:
        socket.create_connection(tuple(target), timeout=3).close()
        return "connected"
    except OSError as exc:
        return f"no connection: {exc}"

if sys.argv[1] == "dial":
    print(json.dumps([dial(t) for t in json.loads(sys.argv[2])]))
    raise SystemExit
overlay, lan, targets = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
controls = [socket.create_server((overlay, 0)), socket.create_server((lan, 0))]
mine = [list(c.getsockname()[:2]) for c in controls]
as_other = subprocess.run(
    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
     "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
     sys.executable, "-c", sys.argv[4], "dial",
     json.dumps(targets + mine)],
    capture_output=True, text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
results = json.loads(as_other.stdout)
print(json.dumps({"other user": results[:-2], "other user, unfenced LAN control": results[-1],
                  "other user, overlay control": results[-2],
                  "run's user, overlay control": dial(mine[0])}))
"""
"""On one host of the run, as root in its namespace: another local user (uid nobody) dials each
of the run's listeners there and two control listeners of the script's own (one on the overlay
address, fenced as the run's, one on the LAN address, not fenced); the run's own user dials the
overlay control. Refused on the overlay address and connected on the LAN one says the fence,
not the script, stops the other user; the run's user connecting says it stops by uid. (The other
user keeps CAP_DAC_READ_SEARCH to read the interpreter under /root: files, not the network.)"""


def dial_as_local_user(host: Host, overlay: str, targets: list[tuple[str, int]]) -> dict[str, Any]:
    """What another local user of `host` reached of `targets` (see LOCAL_DIAL)."""
    return dict(
        json.loads(
            host.run(
                [
                    sys.executable,
                    "-c",
                    LOCAL_DIAL,
                    overlay,
                    host.address,
                    json.dumps(targets),
                    LOCAL_DIAL,
                ],
                timeout_s=120,
            )
        )
    )


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
            local: dict[str, dict[str, Any]] = {}
            targets: list[tuple[str, str, int, str]] = []
            for name, surface in ATTACKS.items():
                payload = (b"\xff" * 16 if "0xff" in name else b"\x00" * 16).hex()
                for item in found:
                    store = item.host == scenario.hosts[0] and item.port == scenario.port
                    if (surface == "store") != store:
                        continue
                    for address in {item.address, lan[item.host]} - {"127.0.0.1", "::1"}:
                        targets.append((name, address, item.port, payload))
            dialled = json.loads(stranger.run(
                [sys.executable, "-c", DIAL_ALL, json.dumps([t[1:] for t in targets])],
                timeout_s=120))  # fmt: skip
            for (name, address, port, _), result in zip(targets, dialled, strict=True):
                attempts[name].append(f"{result} ({address}:{port})")
            for host in hosts:  # another user on each host of the run
                mine = [
                    (i.address, i.port)
                    for i in found
                    if i.host == host.name and i.address.startswith(OVERLAY_PREFIX)
                ]
                if mine:
                    local[host.name] = dial_as_local_user(host, mine[0][0], mine)
            _wait(roles.procs, list(roles.procs), max(1.0, deadline - time.monotonic()))
            steps = step_metrics(roles.run_dirs[scenario.result_role])
            run_ok, detail = bool(steps), f"{len(steps)} steps logged"
        except HostsError as exc:
            attempts, local = {name: [] for name in ATTACKS}, {}
            run_ok, detail = False, f"failed: {exc} (logs in {out / 'run'})"
        finally:
            for name in scenario.hosts:
                network[name].stop()
    exposure = Exposure(found, attempts, run_ok, detail, local)
    (out / "exposure.json").write_text(json.dumps(
        {"listeners": [vars(item) for item in found], "attempts": attempts, "run_ok": run_ok,
         "detail": detail, "local": local}, indent=2))  # fmt: skip
    return exposure
