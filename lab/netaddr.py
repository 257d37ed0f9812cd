"""Which way traffic to a host leaves this machine: the address and interface the kernel picks.
Shared by the split engine (TensorPipe's and Gloo's interface) and data_parallel (gloo's, and
the store's address)."""

from __future__ import annotations

import socket


def route_towards(host: str) -> tuple[str, str | None]:
    """(this host's address that traffic to `host` leaves from, its interface's name); the
    interface is None when it cannot be told, the address then `host`'s own."""
    import psutil  # here: the split engine's stages import this module

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        target = host if family == socket.AF_INET6 else socket.gethostbyname(host)
        with socket.socket(family, socket.SOCK_DGRAM) as probe:  # sends nothing: routes only
            probe.connect((target, 9))
            source = str(probe.getsockname()[0])
    except OSError:
        return host, None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == family and a.address.split("%")[0] == source for a in addresses):
            return source, name
    return source, None
