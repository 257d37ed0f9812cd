"""torch's elastic agent (the API behind `torchrun`) for one host of a data-parallel job.

`role=worker` runs it in this process: a c10d rendezvous at `cluster.master`, `dp.nnodes` hosts
(agents, not workers), `dp.workers` worker processes here, `dp.max_restarts` restarts of them
all after a failure. A local run is the same agent for a job of one host on loopback.

Where the rendezvous listens, and on what, is decided here rather than left to torch's guesses:

- `is_host`: only the agent on the host that holds the endpoint's address hosts the c10d store
  (network namespaces share one hostname, so torch's hostname match says yes on every host).
- The stores listen on one address only: torch's TCPStore binds every interface, so each is
  given a socket already bound to its address (`master_listen_fd`): the rendezvous's here, the
  workers' in rank 0 (data_parallel.worker) on the address its agent gave the others.
- Each rendezvous round's workers get a store of their own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE):
  with the agent's store shared across rounds, workers started again after a failure read their
  predecessors' gloo addresses (the same keys, no prefix per attempt) and failed to connect,
  sometimes three restarts in a row.
- The agent that serves the rendezvous draws the job's token and the others read it there: each
  worker gets it (data_parallel.worker.JOB_ENV) and writes it into its checkpoints, so workers
  started again go on from this job's checkpoint on every host, even those whose agent counted
  no restart (torch restarts every host's workers after one host's failure, or when a host
  joins, but counts it only where the failure was).
- Gloo listens on the interface that leads to the endpoint (GLOO_SOCKET_IFNAME, unless set) and
  this host tells the others the address on it (`local_addr`), not its hostname's.

Nothing of it authenticates: torch.distributed's store and gloo have none. A rendezvous on a
network address warns so at start-up (docs/data_parallel.md says what to put in front).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from data_parallel.config import DataParallelRunConfig
from data_parallel.network import (
    RendezvousFailedError,
    endpoint_text,
    holds_address,
    listening_store,
    probe_store,
    unreachable,
)
from data_parallel.worker import JOB_ENV, train_worker, training_data
from lab.cli import ConfigError, UserError
from lab.config import is_loopback
from lab.netaddr import route_towards

log = logging.getLogger(__name__)

NO_AUTHENTICATION = (
    "the rendezvous at %s is on a network address: torch.distributed's store and gloo have no "
    "authentication, so anyone who reaches their ports can join the run or disturb it. Keep them "
    "inside a VPN and name its interface in GLOO_SOCKET_IFNAME (e.g. wg0), and firewall the "
    "rendezvous port and gloo's ports to the run's hosts (docs/data_parallel.md)"
)


class WorkerFailedError(UserError, RuntimeError):
    """A worker failed more often than dp.max_restarts allows (its log above has the rest)."""


JOB_KEY = "data_parallel/job"
"""The rendezvous store's key for the job's token (data_parallel.worker.JOB_ENV)."""
UNSHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""1: every rendezvous round's workers start a store of their own (see the module's docstring)."""


@contextlib.contextmanager
def worker_env(interface: str | None, job: str) -> Iterator[None]:
    """The environment of the workers this agent starts: a store of their own per round, the
    job's token, and GLOO_SOCKET_IFNAME (and NCCL's) towards the rendezvous unless the user chose
    one (a VPN's)."""
    names = ["GLOO_SOCKET_IFNAME", *(["NCCL_SOCKET_IFNAME"] if torch.cuda.is_available() else [])]
    chosen = {UNSHARED_STORE: "1", JOB_ENV: job}
    if interface is not None:
        chosen |= {name: interface for name in names if not os.environ.get(name)}
    previous = {name: os.environ.get(name) for name in chosen}
    os.environ.update(chosen)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_config(
    settings: DataParallelRunConfig, *, hosting: bool, local_addr: str
) -> LaunchConfig:
    """torchrun's options, from dp.* and cluster.master."""
    dp, master = settings.dp, settings.cluster.master
    min_nodes, max_nodes = dp.node_bounds
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=dp.workers,
        run_id=f"data_parallel-{master.port}",
        role="data_parallel",
        rdzv_endpoint=endpoint_text(master),
        rdzv_backend="c10d",
        rdzv_configs={
            "join_timeout": dp.join_timeout_s,
            "read_timeout": dp.join_timeout_s,  # the store's connect and read timeout
            "last_call_timeout": dp.last_call_s,
            "is_host": hosting,
        },
        max_restarts=dp.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
    )


def run_agent(settings: DataParallelRunConfig) -> dict[str, float]:
    """This host's agent: its workers trained to the end; returns its first worker's metrics."""
    master = settings.cluster.master
    if master.port == 0:
        raise ConfigError(
            "role=worker needs cluster.master.port: the rendezvous's port, the same on every host"
        )
    where = endpoint_text(master)
    if not is_loopback(master.host):
        log.warning(NO_AUTHENTICATION, where)
    # the c10d rendezvous's store, bound to the endpoint's address, serves until this agent
    # ends; on a host without that address, or where another agent already serves it, it joins
    ours = holds_address(master.host)
    _store = listening_store(master.host, master.port, taken="join") if ours else None
    hosting = _store is not None
    if ours and not hosting:
        log.info("another agent on this host serves the rendezvous at %s: joining it", where)
    # the job's token, set by the agent that serves the rendezvous and read by the others
    if _store is not None:
        _store.set(JOB_KEY, secrets.token_hex(8))
    store = _store or probe_store(master.host, master.port, settings.dp.join_timeout_s)
    job = store.get(JOB_KEY).decode()
    local_addr, interface = route_towards(master.host)
    data = training_data(settings)
    config = launch_config(settings, hosting=hosting, local_addr=local_addr)
    with worker_env(interface, job):
        try:
            results = elastic_launch(config, train_worker)(settings, data)
        except RendezvousConnectionError:
            raise unreachable(where, settings.dp.join_timeout_s) from None
        except RendezvousTimeoutError:
            raise RendezvousFailedError(
                f"the rendezvous at cluster.master={where} did not fill within "
                f"dp.join_timeout_s={settings.dp.join_timeout_s}s (dp.nnodes="
                f"{settings.dp.nnodes} hosts): start role=worker on every host"
            ) from None
        except RendezvousError as exc:
            raise RendezvousFailedError(f"rendezvous at cluster.master={where}: {exc}") from None
        except SignalException as exc:
            raise KeyboardInterrupt(str(exc)) from None
        except ChildFailedError as exc:
            raise WorkerFailedError(failure_line(exc, settings.dp.max_restarts)) from None
    return results[min(results)] if results else {}


def failure_line(error: ChildFailedError, max_restarts: int) -> str:
    """What the first failed worker said, in one line."""
    rank, failure = error.get_first_failure()
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip().splitlines()[0] if str(message).strip() else ""
    how = text or (f"exit code {failure.exitcode}" if failure.exitcode >= 0 else "killed")
    return f"worker rank {rank} failed after {max_restarts} restarts: {how}"
