"""What the lab's tools need from tensor_parallel (lab.registry): its sweep, headline and a cost
model of it on a link, its quick settings, its roles across hosts.

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

from pathlib import Path

from lab.linkmodel import Link
from lab.records import METRICS_FILE, read_records, same_outputs
from lab.registry import Headline, Manifest, Metric, Scenario, Variant, Workload

NAME = "tensor_parallel"
ACROSS = ["model.lab_preset=debug", "tp.max_new_tokens=8", "tp.repeats=1", "tp.baseline=false",
          "num_threads=1", "cluster.overlay.up=true"]  # fmt: skip
"""Both runs' settings (the loopback run: tp.ranks=2 on one host, where the overlay is not
needed and not brought up). Across hosts the store and gloo meet inside the lab's overlay."""
RANKS = [
    ("desktop", "rank0", ["role=rank", "tp.rank=0"]),
    ("laptop", "rank1", ["role=rank", "tp.rank=1"]),
]
"""One rank per host; the desktop's rank 0 holds the rendezvous (cluster.master)."""


def summary(run_dir: Path) -> dict[str, float]:
    """The run's summary record (a local run's own, or rank 0's)."""
    for path in (run_dir / METRICS_FILE, run_dir / "rank0" / METRICS_FILE):
        if path.is_file():
            found = [r for r in read_records(path) if r.get("kind") == "summary"]
            if found:
                return found[-1]
    raise ValueError(f"no tensor_parallel summary in {run_dir}")


def token_ms(run_dir: Path) -> float:
    """The median decode step of the split model (ms)."""
    return float(summary(run_dir)["token_ms"])


def allreduce_steps(ranks: int) -> int:
    """Link crossings one gloo all-reduce waits for: gloo's ring (torch 2.13's ProcessGroupGloo
    default for dense CPU tensors) is a reduce-scatter then an all-gather, 2(N - 1) steps; a
    decode step's tensor (B x hidden) is small, so each step is one segment, one delay."""
    return 2 * (ranks - 1)


def allreduce_on_link_ms(nbytes: float, ranks: int, link: Link) -> float:
    """What `link` adds to one all-reduce of `nbytes` among `ranks` (ms): its steps' one-way
    delays and the bytes each rank sends (2(N - 1)/N of the tensor) at the link's rate."""
    steps = allreduce_steps(ranks)
    return 1e3 * (steps * link.one_way_s + link.serialize_s(steps / ranks * nbytes))


def predict_token_ms(run_dir: Path, link: Link) -> float:
    """The local run's decode step, plus what `link` adds to each of its all-reduces."""
    m = summary(run_dir)
    ranks = int(m["ranks"])
    per_token = float(m["allreduces_per_token"])
    batch_bytes = float(m["allreduce_bytes_per_token"]) * float(m.get("batch", 1))
    each = batch_bytes / per_token if per_token else 0.0
    return float(m["token_ms"]) + per_token * allreduce_on_link_ms(each, ranks, link)


UNREAD = {
    "cluster.link": "netproto's link emulator shapes netproto traffic; gloo's does not cross it",
    "cluster.tls": "gloo does not use TLS (the overlay or the fence keeps strangers out)",
    "cluster.connect_timeout_s": "the ranks wait tp.join_timeout_s",
    "cluster.read_timeout_s": "the ranks wait tp.join_timeout_s",
    "cluster.max_frame_mib": "no netproto frames cross between its ranks",
    "cluster.min_frame_rate_kbps": "no netproto frames cross between its ranks",
    "cluster.max_connections_per_address": "no netproto server runs in it",
    "model.quantization": "tensor_parallel shards full-precision linears",
}


MANIFEST = Manifest(
    name=NAME,
    schema="tensor_parallel.config:TensorParallelRunConfig",
    endpoints=("cluster.master",),
    unread=UNREAD,
    summary="each layer's matrices split across ranks (torch's DTensor plan): faster decoding?",
    headline=Headline(
        "token_ms",
        "decode step (ms, median)",
        token_ms,
        predict_token_ms,
        means="one token for every prompt of the batch, every rank together: lower is faster; "
        "speedup says how it compares with the unsplit model on one rank's cores",
    ),
    workload=Workload(
        (
            Metric("token_ms", "decode step", "ms"),
            Metric("tokens_per_s", "throughput", "tokens/s"),
            Metric("collective_share", "collectives' share of a step", "fraction"),
            Metric("speedup", "unsplit / split step", "x", ratio=True),
        ),
        repeat=lambda cell, repeats: [f"tp.repeats={max(1, repeats)}"],
        baseline="unsplit_token_ms",
        baseline_free=("cluster.",),
    ),
    quick=("model.lab_preset=debug", "tp.max_new_tokens=8", "tp.repeats=1"),
    documented=("num_threads=1",),
    scenario=Scenario(
        NAME,
        "cluster.master",
        RANKS,
        ACROSS,
        same_outputs,
        result_role="rank0",
        netproto=False,
        port=29530,
    ),
    variants=(Variant(NAME, NAME, ACROSS),),
    tour=(),
)
