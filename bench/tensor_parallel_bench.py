"""Tensor parallelism: when does a second machine make decoding faster, and over which links?

1. Memory bandwidth with 1 and 2 concurrent readers (each its own process on its own core,
   summing a 256 MiB tensor; and a cache-sized 1 MiB one beside it).
2. Decode ms a token, three arms alternated (medians): 1 host x 1 core (the unsplit model, one
   thread on one core), 2 hosts x 1 core (tensor_parallel: two ranks, each on its own core,
   meeting through world.group on loopback), 1 host x 2 cores (the unsplit model, 2 threads).
   Both TP engines (local shards + dist.all_reduce; DTensor) on the 2-rank arm.
3. The link grid (`--grid`, root): the 2-rank run across two namespace hosts of one core each
   (labtools.hosts, `--cores-per-host 1`), one-way delay {0, 0.2, 1, 5} ms x rate {1gbit,
   100mbit}, inside the lab's WireGuard overlay (the security policy), each cell beside
   the cost model's prediction, and in its parts: an all-reduce against the model's link term
   (the one-way delays it waited) and the compute between all-reduces against the loopback
   cell's. The delaying forwarder runs at real-time priority (it is the wire, not the hosts'
   work), and each cell records how late it sent packets past their delay.
4. A compute-bound row: a prefill of 256 tokens, 1 host x 1 core vs 2 hosts x 1 core.

The cost model uses local measurements only: compute = bytes a rank reads a token / the
measured per-reader bandwidth (memory-bound decode); per all-reduce: delays(n) x one-way delay
+ bytes each rank sends / rate + a fixed cost. The delays come from the algorithm gloo runs
(tensor_parallel.manifest.allreduce_delays: a ring of 2(n - 1) steps, each a receive notice
then the data, 4(n - 1) one-way delays); the fixed cost of the arms from the loopback arm alone
(its measured step less its predicted compute, over its all-reduces), and the grid's from its
loopback cell alone (0 ms, 1 Gbit/s: the overlay and the namespaces' links included, the
overlay's cost printed), which predicts the other 7 cells. Nothing is fitted to the cells it
predicts. Namespace links are emulated on the same two cores that compute, and both "hosts"
share one memory bus: said beside the figures.

Writes bench/results/tensor_parallel.json; the last line is
`compute-bound row, 2 hosts x 1 core / 1 host x 1 core, <shape>: R`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "tensor_parallel.json"
WORK = Path("outputs/bench/tensor_parallel")
DELAYS_MS = (0.0, 0.2, 1.0, 5.0)
RATES = ("1gbit", "100mbit")
RATE_BPS = {"1gbit": 1e9, "100mbit": 1e8}
SHAPES = {
    # name: (hidden, layers, heads, kv heads, intermediate, vocab)
    "mid-160M": (1024, 8, 16, 8, 2816, 32000),
    "llama-1.1B": (2048, 22, 32, 4, 5632, 32000),
}


def uptime() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ----------------------------------------------------------------------------- 1. bandwidth
def _reader(core: int, nbytes: int, seconds: float, start: Any, out: Any) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    data = torch.ones(nbytes // 4)
    data.sum()
    start.wait()
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        data.sum()
        done += 1
    out.put(done * nbytes / (time.perf_counter() - began) / 1e9)


def bandwidth(readers: int, nbytes: int, seconds: float = 2.0) -> float:
    """GB/s each of `readers` concurrent readers gets (the median of theirs)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(readers), ctx.Queue()
    cores = sorted(os.sched_getaffinity(0))
    procs = [
        ctx.Process(target=_reader, args=(cores[i % len(cores)], nbytes, seconds, start, out))
        for i in range(readers)
    ]
    for p in procs:
        p.start()
    rates = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(rates)


# ----------------------------------------------------------------------------- 2. the arms
def save_shape(name: str, tokenizer_from: Path) -> Path:
    """A random-init Llama of `name`'s shape, saved once (safetensors) with the lab's tiny
    tokenizer beside it; each rank then reads its own slices of it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = WORK / "shapes" / name
    if (folder / "config.json").is_file():
        return folder
    hidden, layers, heads, kv, inter, vocab = SHAPES[name]
    print(f"building {name} (random init, saved once) ...", flush=True)
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    for item in tokenizer_from.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(item, folder / item.name)
    return folder


def _arm(
    rank: int,
    ranks: int,
    port: int,
    secret: str,
    folder: str,
    cores: list[int],
    engine: str,
    task: dict[str, Any],
    out: str,
) -> None:
    import torch

    from lab.config import ClusterConfig, Endpoint
    from tensor_parallel.decode import generate
    from tensor_parallel.group import tp_group
    from tensor_parallel.shard import load_sharded

    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))
    torch.manual_seed(0)
    batch, prompt, new = task["batch"], task["prompt"], task["new_tokens"]
    ids = torch.randint(3, 300, (batch, prompt))
    mask = torch.ones_like(ids)

    def measure(model: torch.nn.Module, sharded: Any = None) -> dict[str, float]:
        with torch.no_grad():
            model(input_ids=ids[:, :8], attention_mask=mask[:, :8])  # warm-up
            if task["kind"] == "prefill":
                times = []
                for _ in range(task["repeats"]):
                    began = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
                    times.append(time.perf_counter() - began)
                return {"ms": 1e3 * statistics.median(times)}
            if sharded is not None:
                sharded.collectives.reset()
            g = generate(
                model,
                ids,
                mask,
                max_new_tokens=new,
                after_prefill=sharded.collectives.reset if sharded else lambda: None,
            )
            row = {"ms": g.median_ms}
            if sharded is not None and sharded.collectives.count:
                steps = len(g.token_s)
                row |= {
                    "allreduces": sharded.collectives.count / steps,
                    "allreduce_bytes": sharded.collectives.nbytes / sharded.collectives.count,
                    "collective_ms": 1e3 * sharded.collectives.seconds / steps,
                }
            return row

    if ranks == 1:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        row = measure(model)
        row["weight_bytes"] = sum(p.numel() * 4 for p in model.parameters())
        Path(out).write_text(json.dumps(row))
        return
    cluster = ClusterConfig(master=Endpoint("127.0.0.1", port), secret=secret)  # a fresh one an arm
    with tp_group(cluster, rank=rank, ranks=ranks, timeout_s=300) as group:
        sharded = load_sharded(
            Path(folder),
            rank=rank,
            ranks=ranks,
            engine=engine,
            dtype=torch.float32,
            device=group.device,
            mesh=group.mesh,
        )
        row = measure(sharded.model, sharded)
        row["weight_bytes"] = sharded.param_bytes
    if rank == 0:
        Path(out).write_text(json.dumps(row))


def run_arm(arm: str, folder: Path, task: dict[str, Any], engine: str = "local") -> dict:
    """One arm's measurement, in fresh processes: `1x1`, `2x1` (TP) or `1x2`."""
    from lab.launch import free_port

    cores = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("spawn")
    out = WORK / f"arm-{arm}-{os.getpid()}.json"
    out.unlink(missing_ok=True)
    port = free_port("127.0.0.1")
    secret = os.urandom(16).hex()  # through spawn's pipe, not argv: no other user reads it
    if arm == "2x1":
        plan = [(r, 2, [cores[r % len(cores)]]) for r in range(2)]
    else:
        plan = [(0, 1, cores[:1] if arm == "1x1" else cores[:2])]
    procs = [
        ctx.Process(target=_arm, args=(r, n, port, secret, str(folder), c, engine, task, str(out)))
        for r, n, c in plan
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"arm {arm} failed ({[p.exitcode for p in procs]})")
    return json.loads(out.read_text())


def alternate(
    folder: Path, task: dict[str, Any], arms: list[tuple[str, str]], rounds: int
) -> dict[str, dict]:
    """Each arm `rounds` times, in turn (others' load spread over all of them); medians."""
    seen: dict[str, list[dict]] = {f"{a}/{e}": [] for a, e in arms}
    for index in range(rounds):
        for arm, engine in arms:
            row = run_arm(arm, folder, task, engine)
            seen[f"{arm}/{engine}"].append(row)
            print(
                f"  round {index + 1} {arm:>4} {engine:<7} {row['ms']:8.2f} ms (load {uptime()})",
                flush=True,
            )
    return {
        key: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for key, rows in seen.items()
    }


# ----------------------------------------------------------------------------- the model
def predict_tp(
    row_1x1: dict,
    row_tp: dict,
    bw_gbs: float,
    *,
    loop_ms: float | None,
    delay_ms: float = 0.0,
    rate_bps: float | None = None,
) -> dict[str, float]:
    """The cost model of a 2-rank decode step (ms): compute from bytes over bandwidth, plus per
    all-reduce its delays, its wire time and the fixed cost of the loopback arm."""
    compute = row_tp["weight_bytes"] / (bw_gbs * 1e9) * 1e3
    count = row_tp.get("allreduces", 0.0)
    fixed = 0.0 if loop_ms is None else max(0.0, (loop_ms - compute) / max(count, 1))
    return {
        "compute_ms": compute,
        "fixed_ms": fixed,
        "ms": compute + count * (fixed + link_ms(row_tp, delay_ms, rate_bps)),
    }


def link_ms(row_tp: dict, delay_ms: float, rate_bps: float | None) -> float:
    """What a link adds to one of the 2-rank run's all-reduces (ms): gloo's delays (two a ring
    step, tensor_parallel.manifest.allreduce_delays) and each rank's bytes at the rate."""
    from tensor_parallel.manifest import allreduce_delays, allreduce_steps

    sent = allreduce_steps(2) / 2 * row_tp.get("allreduce_bytes", 0)
    wire = 0.0 if rate_bps is None else sent * 8 / rate_bps
    return allreduce_delays(2) * delay_ms + 1e3 * wire


CALIBRATION = (0.0, "1gbit")
"""The grid's loopback cell: its measured step gives the fixed cost the other cells are
predicted with (compute, gloo's own work, the overlay and the namespaces' links)."""


def predict_cell(row_tp: dict, calibration_ms: float, delay_ms: float, rate: str) -> float:
    """A grid cell's step (ms): the loopback cell's measured step, plus what this cell's link
    adds to each all-reduce beyond that cell's link."""
    count = row_tp.get("allreduces", 0.0)
    here = link_ms(row_tp, delay_ms, RATE_BPS[rate])
    there = link_ms(row_tp, CALIBRATION[0], RATE_BPS[CALIBRATION[1]])
    return calibration_ms + count * (here - there)


def calibration(cells: list[dict]) -> dict:
    """The grid's loopback cell (CALIBRATION), which the others are predicted from."""
    for c in cells:
        if (c["delay_ms"], c["rate"]) == CALIBRATION:
            return c
    raise ValueError(f"the grid has no loopback cell {CALIBRATION} to calibrate from")


def model_grid(cells: list[dict], row_tp: dict) -> list[dict]:
    """The cells with the current model's predictions (from the loopback cell's measurement)."""
    cal = calibration(cells)["measured_ms"]
    out = []
    for c in cells:
        predicted = predict_cell(row_tp, cal, c["delay_ms"], c["rate"])
        out.append(
            {
                **c,
                "predicted_ms": predicted,
                "ratio": c["measured_ms"] / predicted,
                "calibrates": (c["delay_ms"], c["rate"]) == CALIBRATION,
            }
        )
    return out


def within(cells: list[dict]) -> int:
    """The predicted cells (not the calibrating one) within 0.85-1.15 of the model."""
    return sum(0.85 <= c["ratio"] <= 1.15 for c in cells if not c.get("calibrates"))


def grid_lines(cells: list[dict], rows: dict[str, dict]) -> list[str]:
    """What the grid's cells say together: the overlay's cost, the count within 0.85-1.15 of
    the predicted cells, the crossover."""
    tp = rows["2x1/local"]
    cal = calibration(cells)
    predicted = [c for c in cells if not c.get("calibrates")]
    overlay = (cal["measured_ms"] - tp["ms"]) / max(tp.get("allreduces", 0.0), 1.0)
    return [
        f"the overlay and the namespaces' links: {cal['measured_ms'] - tp['ms']:.2f} ms a token "
        f"over the loopback arm ({overlay:.2f} ms an all-reduce; the loopback cell "
        f"{cal['measured_ms']:.2f} ms, the loopback arm {tp['ms']:.2f} ms)",
        f"cells within 0.85-1.15 of the cost model: {within(cells)} of {len(predicted)} predicted "
        f"(the 0 ms, 1 Gbit/s cell calibrates the fixed cost)",
        crossover_line(crossover(cells, rows)),
        *parts_lines(cells, tp),
    ]


# ----------------------------------------------------------------------------- 3. the grid
def grid(folder: Path, row_tp: dict, repeats: int) -> list[dict]:
    """The 2-rank run across two namespace hosts of one core each, cell by cell, the loopback
    cell first (it calibrates the others' predictions)."""
    from labtools.hosts.network import Network, cores_line

    cells: list[dict[str, Any]] = []
    secret = os.urandom(16).hex()
    # the delaying forwarder at real-time priority: at normal priority it waits for a core while
    # the ranks compute, and each packet arrives that much later than the link's delay
    # (bench/allreduce_link.py measured it: labtools.linkdelay.ForwardStats)
    with Network(
        ["desktop", "laptop"],
        delay_ms=0,
        root=WORK / "hosts",
        cores_per_host=1,
        realtime_forwarder=True,
    ) as network:
        print(cores_line(network), flush=True)
        desktop = network["desktop"]
        for delay in DELAYS_MS:
            for rate in RATES:
                network.set_link(delay_ms=delay, rate=rate)
                measured, summaries = [], []
                for attempt in range(repeats):
                    run_dir = WORK / "grid" / f"{delay}-{rate}-{attempt}"
                    procs = []
                    for rank, host in enumerate(network.hosts.values()):
                        argv = [
                            sys.executable,
                            "-m",
                            "tensor_parallel",
                            "role=rank",
                            f"tp.rank={rank}",
                            "tp.ranks=2",
                            f"model.pretrained={folder.resolve()}",
                            f"cluster.master.host={desktop.address}",
                            "cluster.master.port=29530",
                            "cluster.overlay.up=true",  # where the security policy puts it
                            "tp.baseline=false",
                            "tp.max_new_tokens=24",
                            "tp.prompts=[import os]",
                            "tp.repeats=1",
                            "num_threads=1",
                            "tracking.wandb=false",
                            f"hydra.run.dir={run_dir}/{host.name}",
                        ]
                        procs.append(
                            host.start(
                                argv, run_dir / f"{host.name}.log", env={"LAB_SECRET": secret}
                            )
                        )
                    for proc in procs:
                        proc.wait(timeout=1800)
                    metrics = run_dir / "desktop" / "metrics.jsonl"
                    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
                    summaries.append([r for r in rows if r.get("kind") == "summary"][-1])
                    measured.append(float(summaries[-1]["token_ms"]))
                ms = statistics.median(measured)
                cells.append(
                    {"delay_ms": delay, "rate": rate, "measured_ms": ms, **step_parts(summaries)}
                )
                # what the wire did in this cell: its packets' lateness beyond the delay
                wire = network.reset_forwarder()
                cells[-1]["forwarder"] = wire
                late = (wire or {}).get("late_mean_ms", float("nan"))
                cell = model_grid(cells, row_tp)[-1]
                print(
                    f"{cell_line(cell)} (load {uptime()}; forwarder {late:.3f} ms late a packet)",
                    flush=True,
                )
    return model_grid(cells, row_tp)


def step_parts(summaries: list[dict]) -> dict[str, float]:
    """A cell's step in its parts (medians over its runs): one all-reduce (ms, a run's mean) and
    the compute between the all-reduces (ms a token); nothing where the runs did not say."""
    if not summaries or not all("collective_ms_per_token" in s for s in summaries):
        return {}
    return {
        "allreduce_ms": statistics.median(
            s["collective_ms_per_token"] / s["allreduces_per_token"] for s in summaries
        ),
        "compute_ms": statistics.median(s["compute_ms_per_token"] for s in summaries),
        "compute_cpu_ms": statistics.median(
            s.get("compute_cpu_ms_per_token", float("nan")) for s in summaries
        ),
    }


def parts_lines(cells: list[dict], row_tp: dict) -> list[str]:
    """Each cell's step in its parts against the loopback cell's: an all-reduce, measured and
    predicted (the loopback cell's plus the link's term), and the one-way delays it waited; the
    compute a token, which the model takes to be the loopback cell's in every cell."""
    from tensor_parallel.manifest import allreduce_delays

    cal = calibration(cells)
    if "allreduce_ms" not in cal:
        return []
    lines = [
        "the step in its parts (an all-reduce measured / predicted, the one-way delays it "
        "waited; the compute between all-reduces a token, against the loopback cell's "
        f"{cal['compute_ms']:.2f} ms):"
    ]
    there = link_ms(row_tp, CALIBRATION[0], RATE_BPS[CALIBRATION[1]])
    for c in cells:
        if c is cal or "allreduce_ms" not in c:
            continue
        here = link_ms(row_tp, c["delay_ms"], RATE_BPS[c["rate"]])
        predicted = cal["allreduce_ms"] + here - there
        wire = (here - there) - allreduce_delays(2) * (c["delay_ms"] - CALIBRATION[0])
        waited = (
            f"{(c['allreduce_ms'] - cal['allreduce_ms'] - wire) / c['delay_ms']:.2f} one-way "
            f"delays, the model {allreduce_delays(2)}"
            if c["delay_ms"]
            else "no delay"
        )
        lines.append(
            f"  {c['delay_ms']:4.1f} ms {c['rate']:>8}: an all-reduce {c['allreduce_ms']:.2f} / "
            f"{predicted:.2f} ms ({c['allreduce_ms'] / predicted:.2f}; {waited}); compute "
            f"{c['compute_ms']:.2f} ms a token ({c['compute_ms'] / cal['compute_ms']:.2f}x; "
            f"its CPU {c.get('compute_cpu_ms', float('nan')):.2f} ms, the loopback cell's "
            f"{cal.get('compute_cpu_ms', float('nan')):.2f})"
        )
    return lines


def cell_line(c: dict) -> str:
    said = "calibrates" if c.get("calibrates") else f"ratio {c['ratio']:.2f}"
    return (
        f"  {c['delay_ms']:4.1f} ms {c['rate']:>8}: measured {c['measured_ms']:8.2f} ms, "
        f"predicted {c['predicted_ms']:8.2f} ms, {said}"
    )


def crossover(cells: list[dict], rows: dict[str, dict]) -> dict[str, float | None]:
    """The one-way delay (ms) beyond which 2 hosts x 1 core loses to 1 host x 1 core at 1 Gbit/s:
    measured (linear between the grid's delays; 0 if it loses at 0 ms, None if never within the
    grid) and predicted (the loopback cell's step plus each all-reduce's delays)."""
    from tensor_parallel.manifest import allreduce_delays

    one, tp = rows["1x1/-"]["ms"], rows["2x1/local"]
    cal = calibration(cells)["measured_ms"]
    predicted = (one - cal) / (tp["allreduces"] * allreduce_delays(2))
    line = sorted((c["delay_ms"], c["measured_ms"]) for c in cells if c["rate"] == "1gbit")
    measured: float | None = None
    if line[0][1] >= one:
        measured = 0.0
    for (d0, m0), (d1, m1) in itertools.pairwise(line):
        if measured is None and m0 < one <= m1:
            measured = d0 + (one - m0) / (m1 - m0) * (d1 - d0)
    return {"measured_ms": measured, "predicted_ms": predicted, "one_host_ms": one}


def crossover_line(c: dict[str, float | None]) -> str:
    predicted = c["predicted_ms"]
    said = "TP loses already at 0 ms" if predicted is not None and predicted <= 0 else ""
    measured = "beyond the grid" if c["measured_ms"] is None else f"{c['measured_ms']:.2f} ms"
    return (
        f"crossover one-way delay (TP slower than one host beyond it), 1 Gbit/s: measured "
        f"{measured}, predicted {predicted:.2f} ms {('(' + said + ')') if said else ''}"
    )


def remodel(results: dict[str, Any]) -> None:
    """The results' grid and crossover as the current cost model predicts them, in place."""
    for shape in results["shapes"].values():
        if shape.get("grid"):
            shape["grid"] = model_grid(shape["grid"], shape["decode"]["2x1/local"])
            shape["crossover"] = crossover(shape["grid"], shape["decode"])
            shape["grid_within"] = within(shape["grid"])
    results["remodelled"] = (
        f"{time.strftime('%Y-%m-%d')}: grid predictions recomputed by the current cost model "
        "from the measurements above (tensor_parallel_bench.py --remodel)"
    )


def report(results: dict[str, Any]) -> None:
    """A results file's grid, crossover and compute-bound ratio, as the run printed them."""
    print(f"load before {results['load_before']}, after {results['load_after']}")
    last = list(results["shapes"])[-1]
    shape = results["shapes"][last]
    if shape.get("grid"):
        print(f"{last}: the link grid as measured, predicted by the current cost model")
        cells = model_grid(shape["grid"], shape["decode"]["2x1/local"])
        for c in cells:
            print(cell_line(c))
        for line in grid_lines(cells, shape["decode"]):
            print(line)
    ratio = results["compute_bound_ratio"]
    print(f"compute-bound row, 2 hosts x 1 core / 1 host x 1 core, {last} prefill 256: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["tiny_target", "mid-160M"],
        help=f"tiny_target and/or {list(SHAPES)}",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the arms")
    parser.add_argument("--grid", action="store_true", help="the link grid (root, namespaces)")
    parser.add_argument("--grid-repeats", type=int, default=1)
    parser.add_argument(
        "--compute-row-only",
        action="store_true",
        help=f"measure the compute-bound row again into {RESULTS.name}",
    )
    parser.add_argument(
        "--from-results",
        action="store_true",
        help=f"measure nothing: {RESULTS.name}'s grid (the current model), crossover, ratio",
    )
    parser.add_argument(
        "--remodel",
        action="store_true",
        help=f"as --from-results, and write the current model's grid predictions into "
        f"{RESULTS.name} (its measurements untouched; the file says it was remodelled)",
    )
    args = parser.parse_args()
    if args.from_results or args.remodel:
        stored = json.loads(RESULTS.read_text())
        report(stored)
        if args.remodel:
            remodel(stored)
            RESULTS.write_text(json.dumps(stored, indent=2) + "\n")
            print(f"wrote the current model's predictions into {RESULTS}")
        return
    from lab.config import ModelConfig, default_cache_dir
    from lab.machine import announce_machine
    from lab.models import resolve_source

    machine = announce_machine()
    WORK.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any]
    if args.compute_row_only:  # the other rows as the results file has them
        results = {
            k: v
            for k, v in json.loads(RESULTS.read_text()).items()
            if k not in ("command", "machine")
        }
        tiny = Path(resolve_source(ModelConfig(), cache_dir=default_cache_dir()))
        last = args.shapes[-1]
        folder = tiny if last == "tiny_target" else save_shape(last, tiny)
        compute_row(results, last, folder, args.rounds, machine)
        return
    print(f"load before: {uptime()}", flush=True)
    big, small = 256 * 2**20, 2**20
    bw = {
        "1 reader": bandwidth(1, big),
        "2 readers": bandwidth(2, big),
        "1 reader, 1 MiB": bandwidth(1, small),
        "2 readers, 1 MiB": bandwidth(2, small),
    }
    print("memory bandwidth (GB/s per reader): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))
    scales = bw["2 readers"] / bw["1 reader"]
    if scales < 0.8:
        print(
            f"this box's memory bandwidth does not scale: two readers get {scales:.2f} of one's "
            "each (one bus), so a memory-bound TP figure here under-states two real hosts"
        )
    tiny = Path(resolve_source(ModelConfig(), cache_dir=default_cache_dir()))
    results = {"bandwidth_gbs": bw, "load_before": uptime(), "shapes": {}}
    decode = {"kind": "decode", "batch": 1, "prompt": 16, "new_tokens": 24, "repeats": 1}
    for shape in args.shapes:
        folder = tiny if shape == "tiny_target" else save_shape(shape, tiny)
        print(f"{shape}: decode, batch 1 ({args.rounds} rounds, arms alternated)", flush=True)
        arms = [("1x1", "-"), ("2x1", "local"), ("2x1", "dtensor"), ("1x2", "-")]
        rows = alternate(folder, decode, arms, args.rounds)
        one, tp, tp_dt, two = rows["1x1/-"], rows["2x1/local"], rows["2x1/dtensor"], rows["1x2/-"]
        shared = predict_tp(one, tp, bw["2 readers"], loop_ms=tp["ms"])
        real = predict_tp(one, tp, bw["1 reader"], loop_ms=None)
        real["ms"] += tp["allreduces"] * shared["fixed_ms"]  # same fixed cost, a bus each
        print(f"{'arm':<28}{'ms/token':>10}")
        for label, row in (
            ("1 host x 1 core", one),
            ("2 hosts x 1 core (TP, local)", tp),
            ("2 hosts x 1 core (TP, DTensor)", tp_dt),
            ("1 host x 2 cores", two),
        ):
            print(f"{label:<30}{row['ms']:8.2f}")
        print(
            f"TP speedup over 1 x 1: {one['ms'] / tp['ms']:.2f}x (local), "
            f"{one['ms'] / tp_dt['ms']:.2f}x (DTensor); {tp['allreduces']:.0f} all-reduces a "
            f"token, {tp['collective_ms']:.2f} ms of the step in them; cost model for two real "
            f"hosts of this CPU (a memory bus each, fixed cost from loopback): "
            f"{real['ms']:.2f} ms ({one['ms'] / real['ms']:.2f}x)"
        )
        results["shapes"][shape] = {
            "decode": rows,
            "model_shared_bus": shared,
            "model_two_real_hosts": real,
        }
    last = args.shapes[-1]
    folder = tiny if last == "tiny_target" else save_shape(last, tiny)
    if args.grid:
        print(
            f"{last}: the link grid, 2 hosts x 1 core (namespaces; links emulated on the "
            "same cores)"
        )
        rows = results["shapes"][last]["decode"]
        cells = grid(folder, rows["2x1/local"], args.grid_repeats)
        results["shapes"][last]["grid"] = cells
        results["shapes"][last]["crossover"] = crossover(cells, rows)
        results["shapes"][last]["grid_within"] = within(cells)
        for line in grid_lines(cells, rows):
            print(line)
    compute_row(results, last, folder, args.rounds, machine)


def compute_row(
    results: dict[str, Any], last: str, folder: Path, rounds: int, machine: Any
) -> None:
    """The compute-bound row (a prefill of 256 tokens, the last position's logits only, as
    generation needs), 1 x 1 against 2 x 1 alternated; written into `results` and printed last."""
    from lab.machine import write_results

    prefill = {"kind": "prefill", "batch": 1, "prompt": 256, "new_tokens": 0, "repeats": 3}
    print(f"{last}: compute-bound row (prefill of 256 tokens), load {uptime()}", flush=True)
    rows = alternate(folder, prefill, [("1x1", "-"), ("2x1", "local")], rounds)
    ratio = rows["1x1/-"]["ms"] / rows["2x1/local"]["ms"]
    results["shapes"].setdefault(last, {})["prefill_256"] = rows
    results["compute_bound_ratio"] = ratio
    results["load_after"] = uptime()
    write_results(RESULTS, results, machine=machine)
    print(f"load after: {uptime()}")
    print(f"compute-bound row, 2 hosts x 1 core / 1 host x 1 core, {last} prefill 256: {ratio:.2f}")


if __name__ == "__main__":
    main()
