"""Where a split run's processes listen, once it is safe to: loopback as it is (a local run's
address behind the fence, `lab.fence`), inside the lab's WireGuard overlay with its address
fenced, or the user's own VPN; anything else refused in one line. And the interface TensorPipe
and Gloo are pointed at, so they listen and advertise where their peers reach them."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from lab.cli import ConfigError, UserError
from lab.config import ClusterConfig, Endpoint, is_loopback
from lab.fence import FenceError, nftables_fence
from lab.netaddr import route_towards

log = logging.getLogger(__name__)

DRIVER = "driver"
"""Rank 0's worker name; stage k is rank k (`stage_name`)."""


def stage_name(rank: int) -> str:
    return f"stage{rank}"


def interface_towards(host: str) -> str | None:
    """The name of this machine's network interface that traffic to `host` leaves by (the one
    holding the address the kernel picks as source for it); None when it cannot be told."""
    return route_towards(host)[1]


INTERFACE_VARIABLES = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
"""What picks the interface each of torch.distributed.rpc's two networks listens on and
advertises: TensorPipe's, and the Gloo group `init_rpc` builds beside it."""


@contextmanager
def _listening_towards_the_master(master: Endpoint) -> Iterator[None]:
    """TensorPipe, and the Gloo group init_rpc builds beside it, listen on and tell their peers
    the address of the interface of this host's name unless TP_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    name one. On Debian the host's name resolves to 127.0.1.1, so a stage on a LAN advertised
    loopback (Gloo's full mesh then failed with "connection refused, remote=127.0.0.1", found
    by `python -m labtools.hosts check`); on a host whose name resolves to its LAN address, a
    loopback run was reachable from the LAN. Every rank reaches the master, so the interface
    that leads there is the one its peers can reach it on: both listen there only, while the
    agent starts (they read the variables then; a later world in this process decides anew).
    A variable the user set (a VPN's `wg0`) is kept."""
    interface = interface_towards(master.host)
    unset = [name for name in INTERFACE_VARIABLES if not os.environ.get(name)]
    if interface is None or not unset:
        yield
        return
    log.info("TensorPipe listens on %s (the interface towards %s)", interface, master.host)
    for name in unset:
        os.environ[name] = interface
    try:
        yield
    finally:
        for name in unset:
            os.environ.pop(name, None)


class OverlayUnavailableError(UserError, RuntimeError):
    """cluster.overlay.up=true, and the overlay could not be brought up."""


def plain_network_refusal(cluster: ClusterConfig, interface: str | None) -> str:
    host = cluster.master.host
    where = f"through {interface}" if interface else "over the network"
    return (
        f"a split run listens only on loopback or inside an authenticated overlay, and "
        f"cluster.master.host={host} is reached {where}: anyone who reaches TensorPipe's ports "
        f"there can read and write this host's files. Set cluster.overlay.up=true (the lab's "
        f"WireGuard, as root, with the shared secret), or cluster.overlay.interface=<your VPN's "
        f"interface> with cluster.master.host the driver's address on it; only on a network you "
        f"fully trust, cluster.unsafe_plain_network=true"
    )


@contextmanager
def safe_master(
    cluster: ClusterConfig, *, rank: int, num_stages: int, timeout_s: float
) -> Iterator[Endpoint]:
    """Where this rank's world meets, once it is safe to listen: loopback as it is; across hosts
    inside the lab's WireGuard overlay (`cluster.overlay.up`, brought up here and torn down after
    the block: the driver's host is its hub, and the world meets at the hub's overlay address) or
    the user's own (`cluster.overlay.interface`, checked to be the way to the master). Anything
    else is refused in one line unless `cluster.unsafe_plain_network` says otherwise."""
    master, overlay = cluster.master, cluster.overlay
    if is_loopback(master.host):  # one machine: nothing to reach from outside
        yield master
        return
    if overlay.up:
        from netproto import overlay as wg

        secret = cluster.resolved_secret()
        if secret is None:
            raise ConfigError(
                "cluster.overlay.up=true needs the shared secret (LAB_SECRET or "
                "cluster.secret_file): the overlay's keys are set up with it"
            )
        port = overlay.port or master.port + 1
        if rank == 0:
            names = frozenset(stage_name(rank) for rank in range(1, num_stages + 1))
            held = wg.hub(listen=master.host, port=port, num_peers=num_stages, secret=secret,
                          names=names, subnet=overlay.subnet, timeout_s=timeout_s)  # fmt: skip
        else:
            held = wg.join(hub_address=master.host, port=port, secret=secret,
                           name=stage_name(rank), timeout_s=timeout_s)  # fmt: skip
        with contextlib.ExitStack() as stack:
            try:
                membership = stack.enter_context(held)
            except wg.OverlayError as exc:
                raise OverlayUnavailableError(f"cluster.overlay.up=true: {exc}") from None
            log.info("%s in the overlay at %s (%s)", stage_name(rank) if rank else DRIVER,
                     membership.address, membership.interface)  # fmt: skip
            # the overlay keeps the network out; the fence keeps out this host's other users
            try:
                fence = stack.enter_context(nftables_fence(membership.address))
            except FenceError as exc:
                raise OverlayUnavailableError(f"cluster.overlay.up=true: {exc}") from None
            log.info("%s", fence.describe())
            # our own interface, also where two roles share a host (the way to the hub's address
            # is then another role's interface)
            saved = {name: os.environ.get(name) for name in INTERFACE_VARIABLES}
            os.environ.update(dict.fromkeys(INTERFACE_VARIABLES, membership.interface))
            try:
                yield Endpoint(membership.hub_address, master.port)
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
        return
    interface = interface_towards(master.host)
    if overlay.interface:
        if interface != overlay.interface:
            raise ConfigError(
                f"cluster.overlay.interface={overlay.interface}, but cluster.master.host="
                f"{master.host} is reached through {interface or 'no interface'}: set "
                f"cluster.master.host to the driver's address on {overlay.interface}"
            )
        yield master
        return
    if not cluster.unsafe_plain_network:
        raise ConfigError(plain_network_refusal(cluster, interface))
    log.warning(
        "cluster.unsafe_plain_network=true: this split run listens on %s, where anyone who "
        "reaches its ports can read and write this host's files",
        interface or master.host,
    )
    yield master
