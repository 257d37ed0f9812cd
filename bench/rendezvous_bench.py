"""The elastic agents' rendezvous on the lab's authenticated store, beside torch's TCPStore.

Run: `python bench/rendezvous_bench.py [--quick]`.

N agents (threads of this process, each with a connection of its own, on loopback) meet as
data_parallel's agents do: torch's `DynamicRendezvousHandler` over `C10dRendezvousBackend`
(`next_rendezvous`, whose join polls the state once a second), then torch's own rank assignment
(`SimpleElasticAgent._assign_worker_ranks`: rank 0 reads every agent's role with `multi_get`
and writes every assignment with `multi_set`). Three stores, alternated round by round:

- `lab, batch calls`: world.store's AuthenticatedStore with the secret (what runs);
- `lab, one call per key`: the same without `multi_get` / `multi_set`, so torch falls back to a
  get or set per key (a Python `dist.Store` without the batch calls);
- `TCPStore`: torch's own C++ store, unauthenticated (what data_parallel served before).

Prints the median time of each phase and the store's round trips (counted by the server),
writes bench/results/rendezvous_bench.json, and ends with the lab store's rendezvous time over
TCPStore's.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from lab.machine import announce_machine, write_results
from world.store import AuthenticatedStore, StoreServer, connect, elastic_keys

RESULTS = Path(__file__).resolve().parent / "results" / "rendezvous_bench.json"
SECRET = b"rendezvous-bench-secret-of-32-by"


class OneCallPerKey(AuthenticatedStore):
    """AuthenticatedStore without the batch calls: c10d's Store then gets and sets key by key."""

    multi_get = dist.Store.multi_get  # type: ignore[assignment]
    multi_set = dist.Store.multi_set  # type: ignore[assignment]


def meet(stores: list[dist.Store], run_id: str) -> tuple[float, float]:
    """Every agent's rendezvous and rank assignment; (seconds until the last rendezvous
    returned, seconds from then until the last agent had its ranks: an agent's own rendezvous
    can return up to a second after another's, its join polling once a second, and rank 0's
    `multi_get` waits for it)."""
    num = len(stores)
    spec = WorkerSpec(role="bench", local_world_size=1, entrypoint="unused",
                      rdzv_handler=None)  # type: ignore[arg-type]  # fmt: skip
    times: dict[int, tuple[float, float]] = {}
    errors: list[BaseException] = []
    started = time.perf_counter()

    def agent(index: int) -> None:
        try:
            store = stores[index]
            params = RendezvousParameters("c10d", "unused:0", run_id, num, num,
                                          join_timeout=120, last_call_timeout=1)  # fmt: skip
            handler = create_handler(store, C10dRendezvousBackend(store, run_id), params)
            info = handler.next_rendezvous()
            met = time.perf_counter()
            SimpleElasticAgent._assign_worker_ranks(  # torch's own, as the agent calls it
                None,  # type: ignore[arg-type]
                info.store, info.rank, info.world_size, spec,
            )  # fmt: skip
            times[index] = (met - started, time.perf_counter() - started)
            handler.shutdown()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(num)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    last_met = max(t[0] for t in times.values())
    return last_met, max(t[1] for t in times.values()) - last_met


def lab_stores(server: StoreServer, num: int, kind: type[AuthenticatedStore]) -> list[dist.Store]:
    host, port = server.address
    return [kind(connect(host, port, secret=SECRET, timeout_s=30)) for _ in range(num)]


def main(quick: bool) -> None:
    machine = announce_machine()
    num_agents, rounds = (4, 3) if quick else (8, 7)
    server = StoreServer(host="127.0.0.1", port=0, secret=SECRET, timeout_s=30,
                         keys=elastic_keys("bench")).start()  # fmt: skip
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=30))  # fmt: skip
    arms: dict[str, Callable[[], list[dist.Store]]] = {
        "lab, batch calls": lambda: lab_stores(server, num_agents, AuthenticatedStore),
        "lab, one call per key": lambda: lab_stores(server, num_agents, OneCallPerKey),
        "TCPStore (no auth)": lambda: [
            dist.TCPStore("127.0.0.1", tcp.port, is_master=False, timeout=timedelta(seconds=30))
            for _ in range(num_agents)
        ],
    }
    samples: dict[str, dict[str, list[float]]] = {
        name: {"rendezvous_s": [], "assign_ms": [], "requests": []} for name in arms
    }
    for index in range(rounds):
        for name, make in arms.items():
            stores = make()
            before = server.requests
            rendezvous_s, assign_s = meet(stores, f"bench-{index}-{list(arms).index(name)}")
            samples[name]["rendezvous_s"].append(rendezvous_s)
            samples[name]["assign_ms"].append(1e3 * assign_s)
            if name.startswith("lab"):
                samples[name]["requests"].append(server.requests - before)
            for store in stores:
                if isinstance(store, AuthenticatedStore):
                    store.client.close()
    table: dict[str, dict[str, Any]] = {}
    print(f"\n{num_agents} agents, {rounds} rendezvous each (medians)")
    print(f"{'store':<24} {'rendezvous (s)':>15} {'rank assignment (ms)':>21} {'round trips':>12}")
    for name, got in samples.items():
        row = {
            "rendezvous_s": statistics.median(got["rendezvous_s"]),
            "assign_ms": statistics.median(got["assign_ms"]),
            "round_trips": statistics.median(got["requests"]) if got["requests"] else None,
        }
        table[name] = row
        trips = f"{row['round_trips']:.0f}" if row["round_trips"] is not None else "-"
        print(f"{name:<24} {row['rendezvous_s']:>15.2f} {row['assign_ms']:>21.1f} {trips:>12}")
    server.stop()
    ratio = table["lab, batch calls"]["rendezvous_s"] / table["TCPStore (no auth)"]["rendezvous_s"]
    batch = table["lab, one call per key"]["assign_ms"] / table["lab, batch calls"]["assign_ms"]
    write_results(RESULTS, {"quick": quick, "agents": num_agents, "rounds": rounds,
                            "arms": table, "ratio": ratio, "batch_saving": batch},
                  machine=machine)  # fmt: skip
    print(f"rank assignment without / with the batch calls: {batch:.2f}")
    print(f"rendezvous on the lab's store / on torch's TCPStore: {ratio:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 agents, 3 rounds")
    main(parser.parse_args().quick)
