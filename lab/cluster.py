"""Connections and servers configured from the lab's `cluster` settings.

The one place where `cluster.*` (secret, TLS, timeouts, frame cap and minimum rate, one
address's share of a server, emulated link) turns into netproto objects, so every module
connects and serves the same way.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from lab.config import ClusterConfig, Endpoint
from lab.waiting import Wait
from netproto.connection import Connection, client_ssl_context, server_ssl_context
from netproto.errors import ConnectionClosed, NetTimeout
from netproto.header import Limits
from netproto.link import LinkEmulatorProcess
from netproto.server import Handler, Server


def limits_for(cluster: ClusterConfig) -> Limits:
    return Limits(
        max_frame_bytes=cluster.max_frame_mib * 2**20,
        min_frame_bytes_per_s=cluster.min_frame_rate_kbps * 1000 / 8,
    )


def connect(cluster: ClusterConfig, address: tuple[str, int]) -> Connection:
    """A client connection to `address` with the cluster's secret, TLS and timeouts."""
    tls = cluster.tls
    context = client_ssl_context(ca=tls.ca, cert=tls.cert, key=tls.key) if tls.enabled else None
    return Connection.connect(
        *address,
        secret=cluster.resolved_secret(),
        ssl_context=context,
        connect_timeout_s=cluster.connect_timeout_s,
        read_timeout_s=cluster.read_timeout_s,
        limits=limits_for(cluster),
    )


def serve(handler: Handler, cluster: ClusterConfig, endpoint: Endpoint, *, name: str) -> Server:
    """A started server for `handler` on `endpoint` (port 0: any free port)."""
    tls = cluster.tls
    context = None
    if tls.enabled:
        if not (tls.cert and tls.key):
            raise ValueError(
                "cluster.tls.enabled=true on a server needs cluster.tls.cert and cluster.tls.key"
            )
        context = server_ssl_context(cert=tls.cert, key=tls.key, ca=tls.ca)
    return Server(
        handler,
        host=endpoint.host,
        port=endpoint.port,
        secret=cluster.resolved_secret(),
        ssl_context=context,
        limits=limits_for(cluster),
        read_timeout_s=cluster.read_timeout_s,
        handshake_timeout_s=cluster.connect_timeout_s,
        max_connections_per_address=cluster.max_connections_per_address,
        name=name,
    ).start()


@contextlib.contextmanager
def emulated_link(cluster: ClusterConfig, address: tuple[str, int]) -> Iterator[tuple[str, int]]:
    """The address to dial for `address`: through a LinkEmulator when `cluster.link` shapes."""
    link = cluster.link
    if not (link.delay_ms or link.bandwidth_mbps):
        yield address
        return
    # its own process: a drafter or client busy computing would hold back its threads
    with LinkEmulatorProcess(
        address, delay_ms=link.delay_ms, bandwidth_mbps=link.bandwidth_mbps
    ) as emulator:
        yield emulator.address


def connect_when_ready(
    cluster: ClusterConfig,
    address: tuple[str, int],
    *,
    wait_s: float,
    check: Callable[[], None] | None = None,
    poll_s: float = 0.2,
    what: str = "the server",
    where: str = "",
    key: str = "",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Connection:
    """`connect`, retrying while the server is still starting (loading a model, say).

    Raises the last ConnectionClosed / NetTimeout once `wait_s` has passed; `check` runs
    before every try (e.g. to report that the server's process has died). While it waits it
    says so (`lab.waiting`): `what` it dials, `where` (the address the user gave, when
    `address` is an emulated link's end), and `key`, the settings that make `wait_s`.
    """
    where = where or f"{address[0]}:{address[1]}"
    wait = Wait(what, where=where, key=key, limit_s=wait_s, clock=clock)
    deadline = clock() + wait_s
    while True:
        if check is not None:
            check()
        try:
            return connect(cluster, address)
        except (ConnectionClosed, NetTimeout):
            if clock() > deadline:
                raise
            wait.tick()
            sleep(poll_s)
