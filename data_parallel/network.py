"""Where the stores listen and which way the workers' traffic goes: the addresses of this host
towards the rendezvous, and a TCPStore bound to one address (torch's binds every interface)."""

from __future__ import annotations

import errno
import socket
import threading
from datetime import timedelta

import psutil
import torch.distributed as dist

from lab.cli import UserError
from lab.config import Endpoint, is_loopback


class RendezvousFailedError(UserError, RuntimeError):
    """The rendezvous could not be reached, hosted or filled in time."""


def endpoint_text(endpoint: Endpoint) -> str:
    """`host:port`, bracketed for IPv6 (`[::1]:29500`), as torch parses rendezvous endpoints."""
    host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
    return f"{host}:{endpoint.port}"


def holds_address(host: str) -> bool:
    """Whether `host` (an address, or a name resolving to one) is this machine's."""
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


def listening_store(host: str, port: int, *, taken: str = "fail") -> dist.TCPStore | None:
    """A TCPStore server listening on `host`'s address only (port 0: one the OS picks).

    `taken="join"`: None when another process already listens there (a second agent on this
    host joins the first's rendezvous); `"fail"`: RendezvousFailedError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        if taken == "join" and exc.errno == errno.EADDRINUSE:
            return None
        raise RendezvousFailedError(
            f"cannot listen at {endpoint_text(Endpoint(host, port))} ({exc.strerror})"
        ) from None
    bound = int(sock.getsockname()[1])
    return dist.TCPStore(
        host,
        bound,
        is_master=True,
        multi_tenant=True,  # a TCPStore(is_master=True) at this port in this process reuses it
        master_listen_fd=sock.detach(),  # the store owns the socket from here
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )


def probe_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the TCPStore at host:port; RendezvousFailedError unless it answers within
    `timeout_s`.

    torch's TCPStore client waits for ever on a port that accepts and never answers (another
    service, a stopped process, a tarpit), its own timeout notwithstanding (torch 2.13): the
    elastic agent would hang there. So the first connection is made here, in a thread given
    `timeout_s` (the client releases the GIL while it waits; a thread left waiting is a daemon's).
    """
    where = endpoint_text(Endpoint(host, port))
    outcome: dict[str, BaseException | None] = {}
    stores: list[dist.TCPStore] = []

    def connect() -> None:
        try:
            stores.append(
                dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            )
            outcome["error"] = None
        except Exception as exc:  # told to the user below, in one line
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name="rendezvous-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if "error" not in outcome:
        raise RendezvousFailedError(
            f"the rendezvous at cluster.master={where} did not answer within "
            f"dp.join_timeout_s={timeout_s:g}s: something there accepts connections but is not "
            "the rendezvous (another service on that port?)"
        )
    if outcome["error"] is not None:
        raise unreachable(where, timeout_s)
    return stores[0]


def unreachable(where: str, timeout_s: float) -> RendezvousFailedError:
    """The one line for a rendezvous nobody answered at `where` within `timeout_s`."""
    return RendezvousFailedError(
        f"cannot reach the rendezvous at cluster.master={where} within "
        f"dp.join_timeout_s={timeout_s:g}s: is the first host's role=worker running, and "
        "its port open to this host?"
    )
