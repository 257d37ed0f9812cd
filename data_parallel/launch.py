"""torch's elastic agent (the API behind `torchrun`) for one host of a data-parallel job.

`role=worker` runs it in this process: a c10d rendezvous at `cluster.master`, `dp.nnodes` hosts
(agents, not workers), `dp.workers` worker processes here, `dp.max_restarts` restarts of them
all after a failure. A local run is the same agent for a job of one host on loopback.

Where the rendezvous meets, and on what, is the world's (`world.elastic.agent_world`):

- the agent on the host that holds the endpoint's address serves the run's store (netproto with
  the shared secret; a local run draws a secret of its own), every agent reaches it, and torch's
  c10d rendezvous runs over it (`C10dRendezvousBackend`); no TCPStore listens anywhere, the
  workers' included (each round's group is on the same store, under the round's prefix);
- across hosts it meets only inside the lab's overlay (`cluster.overlay.up=true`) or the user's
  VPN (`cluster.overlay.interface`), gloo pinned to that interface; a plain network is refused
  unless `cluster.unsafe_plain_network=true`, which says so; a local run is behind its fence;
- the agent that serves the store draws the job's token and the others read it there: each
  worker gets it (data_parallel.worker.JOB_ENV) and writes it into its checkpoints, so workers
  started again go on from this job's checkpoint on every host, even those whose agent counted
  no restart (torch restarts every host's workers after one host's failure, or when a host
  joins, but counts it only where the failure was).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from data_parallel.config import DataParallelRunConfig
from data_parallel.worker import JOB_ENV, train_worker, training_data
from lab.cli import ConfigError, UserError
from lab.config import Endpoint
from lab.netaddr import route_towards
from world import elastic
from world.group import WorldUnreachableError
from world.network import endpoint_text, holds_address

log = logging.getLogger(__name__)


class RendezvousFailedError(UserError, RuntimeError):
    """The rendezvous could not be reached, hosted or filled in time."""


def unreachable(where: str, timeout_s: float) -> RendezvousFailedError:
    """The one line for a rendezvous nobody answered at `where` within `timeout_s`."""
    return RendezvousFailedError(
        f"cannot reach the rendezvous at cluster.master={where} within "
        f"dp.join_timeout_s={timeout_s:g}s: is the first host's role=worker running, and "
        "its port open to this host?"
    )


class WorkerFailedError(UserError, RuntimeError):
    """A worker failed more often than dp.max_restarts allows (its log above has the rest)."""


JOB_KEY = "data_parallel/job"
"""The rendezvous store's key for the job's token (data_parallel.worker.JOB_ENV)."""
OWN_KEYS = ("data_parallel/",)
"""The keys of the run's store that are data_parallel's own (beside torch's rendezvous)."""


@contextlib.contextmanager
def job_env(job: str) -> Iterator[None]:
    """The job's token in the environment of the workers this agent starts."""
    previous = os.environ.get(JOB_ENV)
    os.environ[JOB_ENV] = job
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(JOB_ENV, None)
        else:
            os.environ[JOB_ENV] = previous


def run_id(settings: DataParallelRunConfig) -> str:
    return f"data_parallel-{settings.cluster.master.port}"


def launch_config(
    settings: DataParallelRunConfig, *, master: Endpoint, local_addr: str
) -> LaunchConfig:
    """torchrun's options, from dp.* and where the world meets (`master`)."""
    dp = settings.dp
    min_nodes, max_nodes = dp.node_bounds
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=dp.workers,
        run_id=run_id(settings),
        role="data_parallel",
        rdzv_endpoint=endpoint_text(master),
        rdzv_backend=elastic.BACKEND,
        rdzv_configs={
            "join_timeout": dp.join_timeout_s,
            "last_call_timeout": dp.last_call_s,
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
    dp = settings.dp
    max_nodes = dp.node_bounds[1]
    with contextlib.ExitStack() as stack:
        try:
            world = stack.enter_context(
                elastic.agent_world(
                    settings.cluster,
                    holds_master=holds_address(master.host),
                    run_id=run_id(settings),
                    num_hosts=max_nodes,
                    timeout_s=dp.join_timeout_s,
                    own_keys=OWN_KEYS,
                    single_host=max_nodes == 1,
                    timeout_key="dp.join_timeout_s",
                )
            )
        except WorldUnreachableError as exc:
            raise RendezvousFailedError(str(exc)) from None
        # the job's token, set by the agent that serves the rendezvous and read by the others
        if world.hosting:
            world.store.set(JOB_KEY, secrets.token_hex(8))
        job = world.store.get(JOB_KEY).decode()
        local_addr = route_towards(world.master.host)[0]
        data = training_data(settings)
        config = launch_config(settings, master=world.master, local_addr=local_addr)
        stack.enter_context(job_env(job))
        where = endpoint_text(world.master)
        try:
            results = elastic_launch(config, train_worker)(settings, data, world.access)
        except RendezvousConnectionError:
            raise unreachable(where, dp.join_timeout_s) from None
        except RendezvousTimeoutError:
            raise RendezvousFailedError(
                f"the rendezvous at cluster.master={where} did not fill within "
                f"dp.join_timeout_s={dp.join_timeout_s}s (dp.nnodes={dp.nnodes} hosts): start "
                "role=worker on every host"
            ) from None
        except RendezvousError as exc:
            raise RendezvousFailedError(f"rendezvous at cluster.master={where}: {exc}") from None
        except SignalException as exc:
            raise KeyboardInterrupt(str(exc)) from None
        except ChildFailedError as exc:
            raise WorkerFailedError(failure_line(exc, dp.max_restarts)) from None
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
