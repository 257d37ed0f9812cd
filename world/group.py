"""A world of N ranks at one endpoint, safe on this network: the one call every parallelism makes.

torchtitan's `distributed/parallel_dims.py` is the shape: one builder that every kind of
parallelism asks for its world, instead of each calling `init_process_group` its own way. Here
the world is what torch.distributed needs (a store and a process group) put where it is safe:

1. where to meet (`world.network.safe_master`): `cluster.master` on loopback as it is (a local
   run's address behind its fence, `world.fence`); across hosts inside the lab's WireGuard
   overlay (`cluster.overlay.up=true`, rank 0's host its hub) or the user's VPN
   (`cluster.overlay.interface`); a plain network refused in one line unless
   `cluster.unsafe_plain_network=true`, which says so;
2. the store (`world.store`): rank 0 serves it at that endpoint, netproto with the shared secret
   (`cluster.secret`, `secret_file` or LAB_SECRET), keys only under `group/`, values capped;
   every rank reaches it as an `AuthenticatedStore`. No TCPStore listens anywhere;
3. the group: `init_process_group(backend, store=PrefixStore(<round>, <our store>))`, never
   `env://`, with Gloo's (and NCCL's bootstrap) sockets on the interface that leads to the
   master (the overlay's, inside it);
4. on leaving: the group destroyed, every rank's word that it left before rank 0 stops the
   store, the overlay torn down.

How an experiment calls it (tensor_parallel: two ranks, one DTensor mesh)::

    from torch.distributed.device_mesh import init_device_mesh
    from world.group import process_group

    def serve_rank(settings: TensorParallelRunConfig) -> dict[str, float]:
        tp = settings.tp
        with process_group(
            settings.cluster,  # cluster.master: where rank 0 serves the store
            rank=tp.rank,
            world_size=tp.world_size,
            backend="nccl" if torch.cuda.is_available() else "gloo",
            name="tensor_parallel",  # the overlay's peer names, the log lines
            timeout_s=tp.join_timeout_s,
        ) as group:
            mesh = init_device_mesh(group.device_type, (tp.world_size,))
            ...  # parallelize_module(model, mesh, {...ColwiseParallel(), RowwiseParallel()})

Its local plan starts one process per rank (`lab.experiment.Process`), and its manifest's
`endpoints=("cluster.master",)` with `Experiment(fence=world.fence.LOCAL_FENCE)` put a local
run's master on the fence's address, where Gloo's listeners are fenced too. Ranks on other
hosts run the same call with their own `rank`; they need the same secret.

data_parallel's workers are started by torch's elastic agent, which has its own rendezvous:
`world.elastic` serves the agents the same store and gives each round's workers their group.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lab.cli import UserError
from lab.config import ClusterConfig, Endpoint
from netproto.errors import AuthenticationError
from world.network import GROUP_VARIABLES, listening_towards, safe_master
from world.store import (
    AuthenticatedStore,
    KeySpace,
    NetprotoStoreClient,
    StoreServer,
    StoreUnreachableError,
    connect,
    group_keys,
    round_prefix,
)

log = logging.getLogger(__name__)

LEFT_KEY = "group/left/{rank}"
"""Set by each rank once its group is destroyed: rank 0 waits for these (at most
`LEFT_TIMEOUT_S`) before it stops the store."""
LEFT_TIMEOUT_S = 10.0


class WorldUnreachableError(UserError, RuntimeError):
    """The world's store could not be reached, or refused this process's secret."""


@dataclass(frozen=True)
class Group:
    """The world a rank is in, for the block of `process_group`."""

    rank: int
    world_size: int
    master: Endpoint
    """Where it met (the hub's overlay address inside the overlay)."""
    backend: str
    store: AuthenticatedStore
    """The world's store (a process group of one's own: `store=PrefixStore(...)` over it)."""

    @property
    def device_type(self) -> str:
        """`init_device_mesh`'s first argument for this backend."""
        return "cuda" if self.backend == "nccl" else "cpu"


@contextlib.contextmanager
def serving_store(
    master: Endpoint,
    *,
    serve: bool,
    secret: bytes | None,
    keys: KeySpace,
    timeout_s: float,
    what: str,
    timeout_key: str = "the timeout",
) -> Iterator[tuple[AuthenticatedStore, StoreServer | None]]:
    """The world's store at `master` for the block: served here when `serve` (rank 0, the agent
    on the master's host), reached by every rank (the server's own too). One line and exit 2
    (WorldUnreachableError) when it cannot be reached within `timeout_s` or refuses the secret;
    while it waits it says so within 5 s and every 30 s. `timeout_key`: the setting that gave
    `timeout_s`, named in the error."""
    server = None
    if serve:
        try:
            server = StoreServer(
                host=master.host, port=master.port, secret=secret, timeout_s=timeout_s, keys=keys
            ).start()
        except OSError as exc:
            raise WorldUnreachableError(
                f"cannot serve the {what}'s store at cluster.master={master.host}:{master.port}: "
                f"{exc.strerror or exc}"
            ) from None
    client: NetprotoStoreClient | None = None
    try:
        try:
            client = connect(
                master.host,
                master.port,
                secret=secret,
                timeout_s=timeout_s,
                describe=lambda waited: (
                    f"waiting for the {what}'s store at cluster.master={master.host}:"
                    f"{master.port} ({waited:.0f}s of {timeout_key}={timeout_s:g}s)"
                ),
            )
        except StoreUnreachableError:
            raise WorldUnreachableError(
                f"no {what} store answered at cluster.master={master.host}:{master.port} within "
                f"{timeout_key}={timeout_s:g}s: is the first host's rank 0 running with the same "
                "cluster.master, and its port open to this host?"
            ) from None
        except AuthenticationError as exc:
            raise WorldUnreachableError(
                f"the {what}'s store at {master.host}:{master.port} refused this process: {exc}"
                " (cluster.secret / secret_file / LAB_SECRET must be the same on every host)"
            ) from None
        try:  # without a secret nothing is said on connecting: a first request tells
            client.num_keys()
        except dist.DistStoreError:
            raise WorldUnreachableError(
                f"no {what} store answered at cluster.master={master.host}:{master.port} within "
                f"{timeout_key}={timeout_s:g}s: something there accepts connections but is not "
                "the rendezvous (another service on that port?)"
            ) from None
        yield AuthenticatedStore(client), server
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()


@contextlib.contextmanager
def process_group(
    cluster: ClusterConfig,
    *,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    name: str = "world",
    timeout_s: float = 300.0,
    device_id: torch.device | None = None,
    timeout_key: str = "the timeout",
) -> Iterator[Group]:
    """Be rank `rank` of a world of `world_size` ranks meeting at `cluster.master`, safe on this
    network (see the module's docstring), for the block: torch's default process group is the
    world's, on the lab's authenticated store. Always leaves it."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    secret = cluster.resolved_secret()
    with (
        safe_master(
            cluster,
            hub=rank == 0,
            name=f"{name}{rank}",
            num_peers=world_size - 1,
            peer_names=frozenset(f"{name}{r}" for r in range(1, world_size)),
            timeout_s=timeout_s,
            what=f"a {name} run",
            danger="anyone who reaches its store and Gloo's ports there can join the world "
            "or disturb it",
        ) as master,
        listening_towards(master, GROUP_VARIABLES),
        serving_store(
            master,
            serve=rank == 0,
            secret=secret,
            keys=group_keys(),
            timeout_s=timeout_s,
            what=f"{name} world",
            timeout_key=timeout_key,
        ) as (store, _),
    ):
        log.info("rank %d of %d joining the %s world at %s:%d", rank, world_size, name,
                 master.host, master.port)  # fmt: skip
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(round_prefix(name), store),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        left = False
        try:
            yield Group(rank, world_size, master, backend, store)
            left = True
        finally:
            dist.destroy_process_group()
            _leave(store, rank=rank, world_size=world_size, orderly=left)


def _leave(store: AuthenticatedStore, *, rank: int, world_size: int, orderly: bool) -> None:
    """Each rank says it left; rank 0 waits for them before its store goes (a rank still
    tearing its group down may read it). Not after a failure: nobody may be left to say so."""
    try:
        if rank != 0:
            store.set(LEFT_KEY.format(rank=rank), "")
        elif orderly:
            keys = [LEFT_KEY.format(rank=r) for r in range(1, world_size)]
            started = time.monotonic()
            store.wait(keys, timedelta(seconds=LEFT_TIMEOUT_S))
            log.debug("every rank left in %.2fs", time.monotonic() - started)
    except dist.DistStoreError as exc:
        log.warning("leaving the world: %s", exc)
