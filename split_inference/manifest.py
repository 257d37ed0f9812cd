"""What the lab's tools need from split_inference (lab.registry): its sweep, plots, headline and
its cost model on a link, its roles across hosts and its curve, its quick settings.

Registered by entry point (pyproject.toml); imports no model code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lab.benchfigures import figure, machine, text
from lab.linkmodel import Link, run_config, run_summary
from lab.plots import pyplot, save, step_rows
from lab.records import METRICS_FILE, read_records, same_outputs
from lab.registry import Headline, Manifest, Metric, Scenario, Variant, Workload
from split_engine.config import UNREAD
from split_engine.placement import ACROSS, DOCUMENTED, SPLIT_ROLES

NAME = "split_inference"


def plots(run_dir: Path) -> list[Path]:
    """Per-token latency (p50 and p95) per batch, split across stages vs the unsplit model;
    with `generate.clients`, throughput and latency against concurrent clients."""
    records = read_records(run_dir / METRICS_FILE)
    return latency_plot(records, run_dir) + serving_plot(records, run_dir)


def serving_plot(records: list[dict[str, Any]], run_dir: Path) -> list[Path]:
    """Throughput over all clients, and per-token latency p50/p95 and time to first token,
    against the number of concurrent clients (`generate.clients`)."""
    rows = sorted(step_rows(records, "serve_clients", "serve_tokens_per_s"),
                  key=lambda r: r["serve_clients"])  # fmt: skip
    if not rows:
        return []
    clients = [r["serve_clients"] for r in rows]
    plt = pyplot()
    fig, (rate, latency) = plt.subplots(1, 2, figsize=(9, 3.5))
    rate.plot(clients, [r["serve_tokens_per_s"] for r in rows], "o-")
    rate.set_xlabel("concurrent clients")
    rate.set_ylabel("tokens/s, all clients")
    rate.set_title("throughput")
    for key, label in (("serve_token_ms_p50", "per token p50"),
                       ("serve_token_ms_p95", "per token p95"),
                       ("serve_ttft_ms_p50", "first token p50")):  # fmt: skip
        latency.plot(clients, [r[key] for r in rows], "o-", label=label)
    latency.set_xlabel("concurrent clients")
    latency.set_ylabel("ms")
    latency.set_title("latency")
    latency.legend(fontsize=8)
    for ax in (rate, latency):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [f"{c:g}" for c in clients])
        ax.grid(alpha=0.3)
    fig.suptitle("several requests in flight through the stages")
    return [save(fig, plt, run_dir / "split_serving.png")]


def latency_plot(records: list[dict[str, Any]], run_dir: Path) -> list[Path]:
    split = {r["step"]: r for r in step_rows(records, "token_ms_p50")}
    unsplit = {r["step"]: r for r in step_rows(records, "unsplit_token_ms_p50")}
    if not split:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    batches = sorted(split)
    width = 0.38
    for offset, rows, prefix, label in (
        (-width / 2, split, "", "split"),
        (width / 2, unsplit, "unsplit_", "unsplit"),
    ):
        shown = [b for b in batches if b in rows]
        if not shown:
            continue
        where = [b + 1 + offset for b in shown]
        p50 = [rows[b][f"{prefix}token_ms_p50"] for b in shown]
        p95 = [rows[b][f"{prefix}token_ms_p95"] for b in shown]
        bars = ax.bar(where, p50, width, label=f"{label} p50 (bar)")
        colour = bars.patches[0].get_facecolor()
        ax.plot(where, p95, "_", color=colour, markersize=22, mew=3, linestyle="none",
                label=f"{label} p95 (tick)")  # fmt: skip
    ax.set_xlabel("measured batch (after the warm-up)")
    ax.set_xticks([b + 1 for b in batches])
    ax.set_ylabel("per-token latency (ms)")
    ax.set_title("decoding: split across stages vs one process")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return [save(fig, plt, run_dir / "split_latency.png")]


def predict_token_ms(run_dir: Path, link: Link) -> float:
    """KV cache on, N stages: the driver asks stage 1 once per generation, and each token then
    goes stage 1 -> ... -> stage N and its answer back: the local token plus 2 (N - 1)
    crossings, the new positions' hidden state at the link's rate each way forward."""
    summary, config = run_summary(run_dir), run_config(run_dir)
    stages = int(config["split"]["num_stages"])
    if not config["generate"].get("kv_cache", True):
        raise ValueError("the model covers split_inference with generate.kv_cache=true")
    hops = stages - 1
    hidden = float(summary["bytes_between_stages_per_token"])  # the forward crossings' bytes
    per_hop = link.serialize_s(hidden / hops)
    return float(summary["token_ms_p50"]) + 1e3 * (2 * hops * link.one_way_s + hops * per_hop)


def token_ms(run_dir: Path) -> float:
    """The median per-token latency of a run."""
    return float(run_summary(run_dir)["token_ms_p50"])


def repeat(cell: Mapping[str, Any], repeats: int) -> list[str]:
    # one batch per repetition: num_prompts = batch_size x repeats, each batch logged as a step
    return [f"generate.num_prompts={int(cell.get('generate.batch_size', 2)) * repeats}"]


def verdict(summary: Mapping[str, Any]) -> list[str]:
    """Split inference's answer: what a split token costs against the unsplit model, and
    what it buys (memory per host)."""
    ratio, memory = float(summary["latency_ratio"]), summary.get("memory_ratio")
    lines = [
        f"split decoding: {float(summary['token_ms_p50']):.1f} ms a token, the unsplit model in "
        f"one process {float(summary['unsplit_token_ms_p50']):.1f} ms: {ratio:.2f}x, "
        + ("slower than unsplit." if ratio > 1 else "no slower than unsplit.")
    ]
    lines.append(
        "Why: each token crosses every stage boundary (an RPC call and its fixed cost each way); "
        "splitting buys memory per host, not speed"
        + (f": the largest stage held {float(memory):.2f} of the unsplit process's memory."
           if memory is not None else ".")
        + " Across real hosts each token also pays the link's delay at every boundary "
        "(docs/split.md); the benchmark: "
        + text(lambda: f"{bench('rows > decode latency > ratio'):.2f}x with random-init Llamas "
               "(`python bench/split_bench.py`).")
    )  # fmt: skip
    return lines


def bench(keys: str) -> float:
    """A figure of bench/results/split_bench.json (lab.benchfigures)."""
    return figure("split_bench", keys)


MANIFEST = Manifest(
    name=NAME,
    schema="split_inference.config:SplitInferenceRunConfig",
    endpoints=("cluster.master",),
    unread=UNREAD,
    summary="a model cut at layer boundaries across hosts (torch.distributed.rpc), decoding",
    headline=Headline(
        "token_ms",
        "per-token latency (ms, median)",
        token_ms,
        predict_token_ms,
        means="one generated token through every stage; latency_ratio sets it against the "
        "unsplit model in one process: splitting buys memory per host, not speed",
        benchmark=lambda: (
            f"split / unsplit per-token latency {bench('rows > decode latency > ratio'):.2f}x "
            f"({bench('rows > decode latency > ours'):.1f} against "
            f"{bench('rows > decode latency > baseline'):.1f} ms, random-init Llamas, "
            f"`python bench/split_bench.py`, loopback, {machine('split_bench')})"
        ),
        benchmark_key="latency_ratio",
        verdict=verdict,
    ),
    workload=Workload(
        (
            Metric("token_ms_p50", "split: per-token latency p50", "ms"),
            Metric("token_ms_p95", "split: per-token latency p95", "ms"),
            Metric("tokens_per_s", "split: throughput", "tokens/s"),
            Metric(
                "serve_tokens_per_s", "split: throughput, generate.clients in flight", "tokens/s"
            ),
            Metric("serve_token_ms_p95", "split: per-token latency p95, clients in flight", "ms"),
            Metric("unsplit_token_ms_p50", "unsplit: per-token latency p50", "ms"),
            Metric("max_stage_peak_rss_mib", "split: peak RSS of the largest stage", "MiB"),
            Metric("unsplit_peak_rss_mib", "unsplit: peak RSS", "MiB"),
            Metric("latency_ratio", "per-token latency p50, split / unsplit", "x", ratio=True),
            Metric("memory_ratio", "peak RSS, largest stage / unsplit", "x", ratio=True),
        ),
        repeat=repeat,
        base=("generate.max_new_tokens=16", "generate.temperature=0"),
        baseline="unsplit_token_ms_p50",
        baseline_free=("split.", "cluster."),
    ),
    # the default tiny model (4 layers: the README cuts it into 3 stages; the debug one has 2)
    quick=("generate.num_prompts=2", "generate.max_new_tokens=8"),
    plots=plots,
    documented=DOCUMENTED,
    scenario=Scenario(
        NAME,
        "cluster.master",
        SPLIT_ROLES,
        [
            *ACROSS,
            # recomputed, not cached: each token's activations are then big enough (about
            # 600 KB in all) that a channel bypassing the links shows in their byte counts
            "generate.kv_cache=false",
            "generate.prompt_tokens=64",
            "generate.num_prompts=2",
            "generate.max_new_tokens=16",
        ],
        same_outputs,
        result_role="driver",
        netproto=False,
        port=29530,
    ),
    variants=(
        Variant(
            NAME,
            NAME,
            [
                *ACROSS,
                "generate.num_prompts=1",
                "generate.max_new_tokens=24",
                "generate.baseline=false",
            ],
        ),
    ),
)
