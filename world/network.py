"""Where a world's ranks meet, once it is safe to: loopback as it is (a local run's address
behind the fence, `world.fence`), inside the lab's WireGuard overlay with its address fenced, or
the user's own VPN; anything else refused in one line (`cluster.unsafe_plain_network=true`
overrides, saying so). And the interface the listeners the run does not authenticate
(TensorPipe's, Gloo's, NCCL's bootstrap) are pointed at, so they listen and advertise where their
peers reach them, nowhere else."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psutil

from lab.cli import ConfigError, UserError
from lab.config import ClusterConfig, Endpoint, is_loopback
from lab.netaddr import route_towards
from world import overlay as wg
from world.fence import FenceError, nftables_fence

log = logging.getLogger(__name__)


def endpoint_text(endpoint: Endpoint) -> str:
    """`host:port`, bracketed for IPv6 (`[::1]:29500`), as torch parses rendezvous endpoints."""
    host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
    return f"{host}:{endpoint.port}"


def holds_address(host: str) -> bool:
    """Whether `host` (an address, or a name resolving to one) is this machine's: the host that
    serves a world's store (network namespaces share one hostname, so a name match says yes on
    every one of them)."""
    if is_loopback(host):
        return True
    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {
        a.address.split("%")[0] for addresses in psutil.net_if_addrs().values() for a in addresses
    }
    return bool(wanted & mine)


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface that traffic to `host` leaves by (the one
    holding the address the kernel picks as source for it); None when it cannot be told."""
    return route_towards(host)[1]


INTERFACE_VARIABLES = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
"""What picks the interface each of torch.distributed.rpc's two networks listens on and
advertises: TensorPipe's, and the Gloo group `init_rpc` builds beside it."""
GROUP_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The same for a process group's backends: Gloo's listeners, NCCL's bootstrap sockets."""


@contextmanager
def listening_towards(
    master: Endpoint, variables: Sequence[str] = INTERFACE_VARIABLES
) -> Iterator[str | None]:
    """TensorPipe and Gloo listen on and tell their peers the address of the interface of this
    host's name unless TP_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name one. On Debian the host's name
    resolves to 127.0.1.1, so a stage on a LAN advertised loopback (Gloo's full mesh then failed
    with "connection refused, remote=127.0.0.1", found by `python -m labtools.hosts check`); on
    a host whose name resolves to its LAN address, a loopback run was reachable from the LAN.
    Every rank reaches the master, so the interface that leads there is the one its peers can
    reach it on: they listen there only, for the block (they read the variables when they
    start; processes started in the block inherit them; a later world decides anew). A variable
    the user set (a VPN's `wg0`, or the overlay's, set by `safe_master`) is kept. Yields the
    interface."""
    interface = interface_towards(master.host)
    unset = [name for name in variables if not os.environ.get(name)]
    if interface is None or not unset:
        yield interface
        return
    log.info("the world's listeners are on %s (the interface towards %s)", interface, master.host)
    for name in unset:
        os.environ[name] = interface
    try:
        yield interface
    finally:
        for name in unset:
            os.environ.pop(name, None)


class OverlayUnavailableError(UserError, RuntimeError):
    """cluster.overlay.up=true, and the overlay could not be brought up."""


def plain_network_refusal(
    cluster: ClusterConfig, interface: str | None, *, what: str, danger: str
) -> str:
    host = cluster.master.host
    where = f"through {interface}" if interface else "over the network"
    return (
        f"{what} listens only on loopback or inside an authenticated overlay, and "
        f"cluster.master.host={host} is reached {where}: {danger}. Set cluster.overlay.up=true "
        f"(the lab's WireGuard, as root, with the shared secret), or cluster.overlay.interface="
        f"<your VPN's interface> with cluster.master.host the first host's address on it; only "
        f"on a network you fully trust, cluster.unsafe_plain_network=true"
    )


SPLIT_DANGER = "anyone who reaches TensorPipe's ports there can read and write this host's files"


@contextmanager
def safe_master(
    cluster: ClusterConfig,
    *,
    hub: bool,
    name: str,
    num_peers: int,
    timeout_s: float,
    peer_names: frozenset[str] | None = None,
    what: str = "a split run",
    danger: str = SPLIT_DANGER,
) -> Iterator[Endpoint]:
    """Where this rank's world meets, once it is safe to listen: loopback as it is; across hosts
    inside the lab's WireGuard overlay (`cluster.overlay.up`, brought up here and torn down after
    the block: the `hub` is the master's host, `num_peers` others join it by `name`, and the world
    meets at the hub's overlay address, its listeners pinned to the overlay's interface) or the
    user's own (`cluster.overlay.interface`, checked to be the way to the master). Anything else
    is refused in one line naming `what` and its `danger`, unless `cluster.unsafe_plain_network`
    says otherwise."""
    master, overlay = cluster.master, cluster.overlay
    if is_loopback(master.host):  # one machine: nothing to reach from outside
        yield master
        return
    if overlay.up:
        secret = cluster.resolved_secret()
        if secret is None:
            raise ConfigError(
                "cluster.overlay.up=true needs the shared secret (LAB_SECRET or "
                "cluster.secret_file): the overlay's keys are set up with it"
            )
        port = overlay.port or master.port + 1
        if hub:
            held = wg.hub(listen=master.host, port=port, num_peers=num_peers, secret=secret,
                          names=peer_names, subnet=overlay.subnet, timeout_s=timeout_s)  # fmt: skip
        else:
            held = wg.join(hub_address=master.host, port=port, secret=secret, name=name,
                           timeout_s=timeout_s)  # fmt: skip
        with contextlib.ExitStack() as stack:
            try:
                membership = stack.enter_context(held)
            except wg.OverlayError as exc:
                raise OverlayUnavailableError(f"cluster.overlay.up=true: {exc}") from None
            log.info("%s in the overlay at %s (%s)", name, membership.address,
                     membership.interface)  # fmt: skip
            # the overlay keeps the network out; the fence keeps out this host's other users
            try:
                fence = stack.enter_context(nftables_fence(membership.address))
            except FenceError as exc:
                raise OverlayUnavailableError(f"cluster.overlay.up=true: {exc}") from None
            log.info("%s", fence.describe())
            # our own interface, also where two roles share a host (the way to the hub's address
            # is then another role's interface)
            variables = (*INTERFACE_VARIABLES, *GROUP_VARIABLES)
            saved = {name: os.environ.get(name) for name in variables}
            os.environ.update(dict.fromkeys(variables, membership.interface))
            try:
                yield Endpoint(membership.hub_address, master.port)
            finally:
                for variable, value in saved.items():
                    if value is None:
                        os.environ.pop(variable, None)
                    else:
                        os.environ[variable] = value
        return
    interface = interface_towards(master.host)
    if overlay.interface:
        if interface != overlay.interface:
            raise ConfigError(
                f"cluster.overlay.interface={overlay.interface}, but cluster.master.host="
                f"{master.host} is reached through {interface or 'no interface'}: set "
                f"cluster.master.host to the first host's address on {overlay.interface}"
            )
        yield master
        return
    if not cluster.unsafe_plain_network:
        raise ConfigError(plain_network_refusal(cluster, interface, what=what, danger=danger))
    log.warning(
        "cluster.unsafe_plain_network=true: %s listens on %s, where %s",
        what,
        interface or master.host,
        danger.replace(" there", ""),
    )
    yield master
