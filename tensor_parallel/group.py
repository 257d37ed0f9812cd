"""Where the ranks meet: the lab's world (`world.group.process_group`, issue 49), and the mesh.

Rank 0 serves the world's authenticated store at cluster.master (netproto, the shared secret,
capped keys: no TCPStore listens anywhere); every rank joins the group through it, gloo on CPU
and NCCL on CUDA, with gloo's sockets on the interface that leads to the master. On loopback the
run's fence (`world.fence`) keeps this host's other users out; across hosts the world admits the
lab's WireGuard overlay (`cluster.overlay.up=true`) or the user's VPN
(`cluster.overlay.interface`), and refuses a plain network in one line unless
`cluster.unsafe_plain_network=true` says otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lab.config import ClusterConfig
from world.group import process_group

NAME = "tensor_parallel"


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


@contextlib.contextmanager
def tp_group(cluster: ClusterConfig, *, rank: int, ranks: int, timeout_s: float) -> Iterator[Group]:
    """This rank in the world of `ranks` meeting at `cluster.master`, with its device mesh, for
    the block; the world is left on the way out (group destroyed, store stopped)."""
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    # a GPU each: NCCL runs no two ranks on one device (a local run's check refuses more ranks
    # than GPUs); a rank on a host without one runs gloo, and every rank must agree (a pair of
    # a GPU host and a CPU host runs with CUDA_VISIBLE_DEVICES= on the GPU host: gloo for both)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with process_group(
        cluster,
        rank=rank,
        world_size=ranks,
        backend="nccl" if cuda else "gloo",
        name=NAME,
        timeout_s=timeout_s,
        device_id=device if cuda else None,
        timeout_key="tp.join_timeout_s",
    ) as world:
        mesh = init_device_mesh(world.device_type, (ranks,))
        yield Group(rank, ranks, device, mesh)
