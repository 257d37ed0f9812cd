"""Where the ranks meet: the one function that brings up tensor_parallel's process group.

Rank 0 serves a c10d store at cluster.master, bound to that address only (torch's TCPStore
would bind every interface); every rank joins the group through it, gloo on CPU and NCCL on
CUDA, and gloo listens on the interface that leads to cluster.master (GLOO_SOCKET_IFNAME, unless
set). torch's store and gloo authenticate nobody, so the master must be a loopback address: a
local run's is the run's fence address (`lab.fence`, Experiment.fenced), which only this user's
processes reach. A master on a network address is refused until the authenticated world of
issue 49 carries the group (docs/tensor_parallel.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lab.cli import ConfigError, UserError
from lab.config import Endpoint, is_loopback
from lab.netaddr import route_towards

log = logging.getLogger(__name__)

FIRST_NOTICE_S = 5.0
NOTICE_EVERY_S = 30.0
KEY_PREFIX = "tensor_parallel/"


class JoinFailedError(UserError, RuntimeError):
    """The ranks did not all reach cluster.master in time."""


@dataclass
class Group:
    """This rank's place in the group."""

    rank: int
    ranks: int
    device: torch.device
    mesh: Any
    """The 1-D device mesh the DTensor engine shards over."""

    def sync(self) -> None:
        """Wait for the device's queued work (a step's clock stops after it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def refuse_network_master(master: Endpoint) -> None:
    """ConfigError unless cluster.master is a loopback address: the group's store and gloo have
    no authentication of their own."""
    if not is_loopback(master.host):
        raise ConfigError(
            f"cluster.master.host={master.host} is a network address: tensor_parallel's store "
            "and gloo authenticate nobody, so its ranks meet on loopback only until the lab's "
            "authenticated world carries them (issue 49; docs/tensor_parallel.md)"
        )


def _bound_store(master: Endpoint, *, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, listening on the master's address only."""
    family = socket.AF_INET6 if ":" in master.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((master.host, master.port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise JoinFailedError(
            f"cannot listen at cluster.master={master.host}:{master.port} ({exc.strerror})"
        ) from None
    return dist.TCPStore(
        master.host,
        int(sock.getsockname()[1]),
        is_master=True,
        master_listen_fd=sock.detach(),
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


@contextlib.contextmanager
def _announcing(what: str) -> Iterator[None]:
    """Say what is awaited after FIRST_NOTICE_S, then every NOTICE_EVERY_S, until the block ends."""
    done = threading.Event()

    def notice() -> None:
        wait = FIRST_NOTICE_S
        while not done.wait(wait):
            log.warning("still waiting: %s", what)
            wait = NOTICE_EVERY_S

    thread = threading.Thread(target=notice, name="join-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextlib.contextmanager
def process_group(master: Endpoint, *, rank: int, ranks: int, timeout_s: float) -> Iterator[Group]:
    """This rank in the group of `ranks` meeting at `master`, for the block; the group is
    destroyed on leaving it (store, gloo or NCCL, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh

    refuse_network_master(master)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    _, interface = route_towards(master.host)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        if cuda:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    where = f"cluster.master={master.host}:{master.port}"
    what = f"rank {rank}: the {ranks} ranks at {where} (tp.join_timeout_s={timeout_s:g})"
    try:
        with _announcing(what):
            if rank == 0:
                store = _bound_store(master, timeout_s=timeout_s)
            else:
                store = dist.TCPStore(
                    master.host, master.port, is_master=False, timeout=timedelta(seconds=timeout_s)
                )
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                store=dist.PrefixStore(KEY_PREFIX, store),
                rank=rank,
                world_size=ranks,
                timeout=timedelta(seconds=timeout_s),
                **({"device_id": device} if cuda else {}),
            )
            mesh = init_device_mesh(device.type, (ranks,))
    except (RuntimeError, dist.DistStoreError) as exc:
        if isinstance(exc, UserError):
            raise
        raise JoinFailedError(
            f"rank {rank} did not meet the other ranks at {where} within "
            f"tp.join_timeout_s={timeout_s:g}s: start role=rank on every host ({exc})"[:400]
        ) from None
    try:
        yield Group(rank, ranks, device, mesh)
    finally:
        dist.destroy_process_group()
        del store
