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
    """Ring steps of one gloo all-reduce: gloo's ring (torch 2.13's ProcessGroupGloo default for
    dense CPU tensors) is a reduce-scatter then an all-gather, 2(N - 1) steps; each rank sends
    2(N - 1)/N of the tensor over them."""
    return 2 * (ranks - 1)


def allreduce_delays(ranks: int) -> int:
    """One-way link delays one gloo all-reduce waits for when the ranks arrive together: two a
    ring step, 4(N - 1). gloo's TCP transport sends into a peer's buffer only once the peer has
    announced the receive (gloo/transport/tcp/pair.cc: a send waits for the peer's
    NOTIFY_RECV_READY), and its ring (gloo/allreduce.cc) posts each phase's receives as the phase
    begins, so a step costs the notice's delay, then the data's. A rank that arrives later
    finds its peer's notice waiting, but its own must still cross before its peer's data comes
    back: it too waits two delays a step from its arrival, and the earlier rank waits its lead
    on top once the lead passes a delay (skew saves nothing). Measured across two hosts: an
    all-reduce of the 1.1B decode waited 4.14 delays at 5 ms one way, 3.78 at 1 ms (the quiet
    grid's rank-0 records, token_ms x collective_share; the grid now prints a step's parts)."""
    return 2 * allreduce_steps(ranks)


def allreduce_on_link_ms(nbytes: float, ranks: int, link: Link) -> float:
    """What `link` adds to one all-reduce of `nbytes` among `ranks` (ms): its delays (two a ring
    step) and the bytes each rank sends (2(N - 1)/N of the tensor) at the link's rate."""
    share = allreduce_steps(ranks) / ranks
    return 1e3 * (allreduce_delays(ranks) * link.one_way_s + link.serialize_s(share * nbytes))


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
