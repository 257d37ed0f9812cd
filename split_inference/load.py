"""`generate.clients=N`: the driver also serves concurrent requests through the pipeline.

After its own timed runs, the driver starts 1, 2, 4, ... up to N client threads (N itself
last), each sending its prompts one after another through `split_engine.batching.Pipeline`
(the same scheduler `role=serve` runs behind HTTP), and logs, per client count, throughput over
all clients, time to first token and per-token latency p50/p95 (one record a client count:
the report plots them against clients, run_matrix sweeps them).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from typing import Any

from split_engine.batching import Pipeline
from split_engine.generation import Sampling


def client_counts(clients: int) -> list[int]:
    """1, 2, 4, ... below `clients`, then `clients`."""
    counts, count = [], 1
    while count < clients:
        counts.append(count)
        count *= 2
    return [*counts, clients]


def _stamp(times: list[float]) -> Any:
    return lambda _: times.append(time.perf_counter())


def serve_load(
    sharded: Any,
    prompts: list[list[int]],
    *,
    clients: int,
    in_flight: int,
    max_new_tokens: int,
    requests_per_client: int = 2,
) -> dict[str, float]:
    """`clients` threads through one pipeline, each `requests_per_client` requests: the
    `serve_*` metrics of one client count (`serve_mean_batch`: rows per stage step)."""
    pipeline = Pipeline(sharded, max_concurrent=clients, in_flight=in_flight, eos_token_id=None)
    firsts: list[float] = []
    gaps: list[float] = []
    tokens = [0]
    failures: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(index: int) -> None:
        start.wait()
        for number in range(requests_per_client):
            prompt = prompts[(index + number * clients) % len(prompts)]
            times: list[float] = []
            began = time.perf_counter()
            try:
                out = pipeline.generate(
                    prompt, Sampling(), max_new_tokens=max_new_tokens, on_token=_stamp(times)
                )
            except BaseException as exc:  # the run fails below, naming it
                with lock:
                    failures.append(exc)
                return
            with lock:
                tokens[0] += len(out)
                firsts.append(times[0] - began)
                gaps.extend(b - a for a, b in itertools.pairwise(times))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    began = time.perf_counter()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        pipeline.close()
    if failures:
        raise failures[0]
    wall = time.perf_counter() - began
    q = statistics.quantiles(gaps, n=20) if len(gaps) > 1 else gaps * 19
    return {
        "serve_clients": float(clients),
        "serve_tokens_per_s": tokens[0] / wall,
        "serve_ttft_ms_p50": statistics.median(firsts) * 1e3,
        "serve_token_ms_p50": statistics.median(gaps) * 1e3 if gaps else 0.0,
        "serve_token_ms_p95": q[18] * 1e3 if gaps else 0.0,
        "serve_mean_batch": pipeline.stats()["mean_batch"],
    }
