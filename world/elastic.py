"""torch's elastic agent (the engine behind `torchrun`) on the world's authenticated store.

Whatever store a c10d rendezvous uses, torch gives the workers a plain TCPStore: shared mode
creates one on rank 0's agent (`dynamic_rendezvous.py`), the opt-out publishes a free port for
`env://` (`RendezvousStoreInfo.build`). So here:

- the agent on the master's host serves the world's store (`world.store.StoreServer`: netproto
  with the shared secret, keys only in `elastic_keys(run_id)`), and every agent reaches it as an
  `AuthenticatedStore`;
- the rendezvous is torch's own (`DynamicRendezvousHandler`, its join, last call, heartbeats and
  rounds) over `C10dRendezvousBackend(<that store>, run_id)`, registered under `BACKEND` and
  picked with `LaunchConfig(rdzv_backend=BACKEND)`;
- TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: no agent starts a TCPStore for its workers (the port it
  still publishes as MASTER_PORT is never listened on);
- each round's group rank 0 draws a token into the round's keys; every agent hands it to the
  workers it starts next (`ROUND_ENV`), and they call `init_process_group(store=PrefixStore(
  round_prefix(<token>), <our store>))` (`worker_group`), never `env://`: a group started again
  after a failure, or after a host joined, never reads its predecessors' gloo addresses.

The agent's batch calls (`multi_get` / `multi_set` in its rank assignment) are one round trip
each on this store; `bench/data_parallel_bench.py --rendezvous` measures what they save.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from lab.config import ClusterConfig, Endpoint
from world.group import WorldUnreachableError, serving_store
from world.network import GROUP_VARIABLES, listening_towards, safe_master
from world.store import (
    AuthenticatedStore,
    NetprotoStoreClient,
    StoreServer,
    connect,
    elastic_keys,
    round_prefix,
)

log = logging.getLogger(__name__)

BACKEND = "lab-c10d"
"""The rendezvous backend name (`LaunchConfig(rdzv_backend=...)`)."""
ROUND_ENV = "LAB_WORLD_ROUND"
"""The current round's token, in the environment of the workers an agent starts."""
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
ROUND_KEY = "lab/round"
"""In each round's keys (`torch.rendezvous.<run_id>.<round>/lab/round`): its token."""

_agent_store: list[AuthenticatedStore] = []
"""The store the handler of this process's agent uses (set for the block of `agent_world`)."""


@dataclass(frozen=True)
class WorkerAccess:
    """What a worker needs to reach its world's store (handed to it as an argument, pickled
    over the spawn pipe: the secret never shows in `ps` or the environment)."""

    host: str
    port: int
    secret: bytes | None
    timeout_s: float


class RoundHandler(RendezvousHandler):
    """torch's dynamic rendezvous, unchanged, that also tells the workers of each round the
    round's token (`ROUND_ENV`). Everything else is delegated."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self.inner = inner

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        if info.rank == 0:
            info.store.set(ROUND_KEY, secrets.token_hex(8))
        token = info.store.get(ROUND_KEY).decode()
        os.environ[ROUND_ENV] = token  # the workers this agent starts next inherit it
        log.info("rendezvous round %s: rank %d of %d hosts", token, info.rank, info.world_size)
        return info

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if not _agent_store:
        raise RuntimeError(f"rdzv_backend={BACKEND} outside world.elastic.agent_world")
    store = _agent_store[-1]
    return RoundHandler(create_handler(store, C10dRendezvousBackend(store, params.run_id), params))


def register() -> None:
    """Register `BACKEND` with torch's rendezvous registry (once a process)."""
    rendezvous_handler_registry.register(BACKEND, _create)


@dataclass(frozen=True)
class AgentWorld:
    """What `agent_world` gives the agent of this host."""

    master: Endpoint
    """Where the world meets (inside the overlay: the hub's overlay address)."""
    store: AuthenticatedStore
    hosting: bool
    """This agent serves the store."""
    access: WorkerAccess
    interface: str | None
    """The interface its workers' Gloo listens on (GLOO_SOCKET_IFNAME)."""


def _serve_here(master: Endpoint, *, secret: bytes | None, run_id: str, own: tuple[str, ...],
                timeout_s: float) -> StoreServer | None:  # fmt: skip
    """The store, served here; None when another agent of this host already serves it."""
    try:
        return StoreServer(
            host=master.host, port=master.port, secret=secret, timeout_s=timeout_s,
            keys=elastic_keys(run_id, own=own),
        ).start()  # fmt: skip
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return None
        raise WorldUnreachableError(
            f"cannot serve the rendezvous at cluster.master={master.host}:{master.port}: "
            f"{exc.strerror or exc}"
        ) from None


@contextlib.contextmanager
def agent_world(
    cluster: ClusterConfig,
    *,
    holds_master: bool,
    run_id: str,
    num_hosts: int,
    timeout_s: float,
    own_keys: tuple[str, ...] = (),
    single_host: bool = False,
    name: str = "data_parallel",
    timeout_key: str = "the timeout",
) -> Iterator[AgentWorld]:
    """This host's agent in the world at `cluster.master`, safe on this network, for the block:
    the overlay joined (or hosted, by the agent that `holds_master`'s address), the store served
    there (by that agent; a second agent of the same host joins it) and reached, the handler
    registered, no TCPStore for the workers, Gloo pinned to the interface towards the master.

    `single_host`: no other host will join (a local run): with no secret set, the store draws
    one of its own, which only this agent and its workers know."""
    secret = cluster.resolved_secret()
    if secret is None and single_host:
        secret = secrets.token_bytes(32)
    peer_name = f"{name}-{os.getpid()}"[:32]
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(
            safe_master(
                cluster,
                hub=holds_master,
                name=peer_name,
                num_peers=num_hosts - 1,
                timeout_s=timeout_s,
                what=f"a {name} run",
                danger="anyone who reaches its rendezvous and Gloo's ports there can join the "
                "run, read its state or overwrite it",
            )
        )
        interface = stack.enter_context(listening_towards(master, _group_variables()))
        server = None
        if holds_master:
            server = _serve_here(master, secret=secret, run_id=run_id, own=own_keys,
                                 timeout_s=timeout_s)  # fmt: skip
            if server is None:
                log.info("another agent on this host serves the rendezvous at %s:%d: joining",
                         master.host, master.port)  # fmt: skip
            else:
                stack.callback(server.stop)
        store, _ = stack.enter_context(
            serving_store(
                master,
                serve=False,
                secret=secret,
                keys=elastic_keys(run_id),
                timeout_s=timeout_s,
                what="rendezvous",
                timeout_key=timeout_key,
            )
        )
        register()
        _agent_store.append(store)
        stack.callback(_agent_store.remove, store)
        previous = os.environ.get(UNSHARED_STORE)
        os.environ[UNSHARED_STORE] = "1"
        stack.callback(_restore, UNSHARED_STORE, previous)
        stack.callback(_restore, ROUND_ENV, os.environ.get(ROUND_ENV))
        access = WorkerAccess(master.host, master.port, secret, timeout_s)
        yield AgentWorld(master, store, server is not None, access, interface)


def _group_variables() -> tuple[str, ...]:
    return GROUP_VARIABLES if torch.cuda.is_available() else GROUP_VARIABLES[:1]


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextlib.contextmanager
def worker_group(
    access: WorkerAccess, *, backend: str, device_id: torch.device | None = None
) -> Iterator[AuthenticatedStore]:
    """A worker of the elastic agent in its round's process group, for the block: RANK and
    WORLD_SIZE as the agent set them, the store reached with the secret, the group on
    `PrefixStore(round_prefix(<round>), store)`; destroyed and disconnected on leaving."""
    round_token = os.environ.get(ROUND_ENV)
    if not round_token:
        raise RuntimeError(f"{ROUND_ENV} unset: this worker was not started by agent_world")
    client: NetprotoStoreClient | None = None
    try:
        client = connect(access.host, access.port, secret=access.secret,
                         timeout_s=access.timeout_s)  # fmt: skip
        store = AuthenticatedStore(client)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(round_prefix(round_token), store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timedelta(seconds=access.timeout_s),
            device_id=device_id,
        )
        try:
            yield store
        finally:
            dist.destroy_process_group()
    finally:
        if client is not None:
            client.close()
