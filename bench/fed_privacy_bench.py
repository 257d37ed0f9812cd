"""Federated LoRA with a hundred clients: what secure aggregation and differential privacy cost.

Local federations of simulated clients (`fed.simulate`: virtual clients in a few processes,
each with its own shard of the stdlib test suite, its own seed, connection and keys; the debug
model; the same rounds and local steps per client everywhere), then:

1. final validation loss at 100 clients: plain FedAvg, secure aggregation (SecAgg+, 10% of the
   clients dropping out of every round after the keys are shared), secure aggregation + DP
   (DP-FedAvg, noise multiplier from a target epsilon of 8 at delta 1e-5; the epsilon the run
   reached is printed) - target: secure with dropouts / plain <= 1.01;
2. bytes each client sends per round, for each;
3. the coordinator's CPU share of a round: its process's CPU seconds in the round (every
   thread, the kernel's process clock: sessions reading answers, sending, unmasking,
   aggregating, evaluating, checkpointing) over the round's wall time, with its CPU
   milliseconds a round beside it, split between the thread that runs the rounds (evaluation
   apart) and the others, and its peak memory at 100 clients - target: share < 0.05;
4. round time at 10, 30 and 100 clients, with and without secure aggregation.

Prints a table, writes bench/results/fed_privacy_bench.json, and ends with the line
`100 clients, secure aggregation with 10% dropouts / plain final validation loss: X,
coordinator CPU share: Y (N ms a round)`. `--quick` runs 20 clients for 2 rounds.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import fed_learn_bench  # bench/ is on the path: this script runs as `python bench/...`

from lab.machine import announce_machine, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "fed_privacy_bench.json"
RUNS = Path("outputs/bench/fed_privacy")


def federate(name: str, overrides: list[str]) -> dict[str, float]:
    """`python -m fed_learn <overrides>`'s `run` in RUNS/name (fed_learn_bench's runner)."""
    return fed_learn_bench.federate(name, overrides, RUNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 clients, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=2)
    parser.add_argument("--neighbors", type=int, default=14, help="SecAgg+ degree")
    parser.add_argument("--epsilon", type=float, default=8.0)
    args = parser.parse_args()
    machine = announce_machine()

    most = 20 if args.quick else 100
    rounds = 2 if args.quick else args.rounds
    common = [
        "model.lab_preset=debug",
        f"fed.rounds={rounds}",
        f"fed.local_steps={args.local_steps}",  # fixed: the share must not come from long training
        "fed.batch_size=4",
        "fed.max_examples_per_client=64",
        "fed.eval_blocks=32",
        "fed.centralized_baseline=false",
        "fed.wait_clients_s=300",
        "fed.round_timeout_s=600",
        "fed.heartbeat_timeout_s=120",
        "fed.secagg.step_timeout_s=120",
        f"fed.secagg.neighbors={args.neighbors}",
    ]

    def clients(n: int) -> list[str]:
        return [f"fed.num_clients={n}", f"fed.min_fit_clients={max(2, n // 2)}",
                f"fed.simulate={max(1, -(-n // 2))}"]  # fmt: skip

    runs: dict[str, dict[str, float]] = {}
    runs["plain"] = federate("plain", [*common, *clients(most)])
    runs["secure_dropout"] = federate(
        "secure_dropout",
        [*common, *clients(most), "fed.secure_aggregation=true", "fed.simulate_dropout=0.1"],
    )
    runs["secure_dp"] = federate(
        "secure_dp",
        [
            *common,
            *clients(most),
            "fed.secure_aggregation=true",
            "fed.dp.enabled=true",
            f"fed.dp.target_epsilon={args.epsilon}",
            "fed.dp.delta=1e-5",
            "fed.dp.clip_norm=1.0",
            "fed.dp.weight_cap=64",
        ],
    )
    timing_rounds = ["fed.rounds=2"]
    sizes = [5, 10] if args.quick else [10, 30, 100]
    for n in sizes:
        for secure in (False, True):
            name = f"{'secure' if secure else 'plain'}_{n}"
            if n == most and not secure:
                continue  # the plain 100-client run above times it
            runs[name] = federate(
                name,
                [*common, *clients(n), *timing_rounds,
                 f"fed.secure_aggregation={str(secure).lower()}"],
            )  # fmt: skip
    runs[f"plain_{most}"] = runs["plain"]

    plain, secured, dp = runs["plain"], runs["secure_dropout"], runs["secure_dp"]
    rows: dict[str, dict[str, Any]] = {}
    for label, run in (("secure, 10% dropouts", secured), ("secure + DP", dp)):
        rows[f"{most} clients, {label} / plain final val loss"] = {
            "ours": run["final_val_loss"],
            "baseline": plain["final_val_loss"],
            "unit": "validation loss",
            "ratio": run["final_val_loss"] / plain["final_val_loss"],
            "target": "<= 1.01" if "dropouts" in label else "",
        }
    for label, run in (("plain", plain), ("secure, 10% dropouts", secured), ("secure + DP", dp)):
        rows[f"bytes up per client per round, {label}"] = {
            "ours": run["bytes_up_per_client_round"],
            "baseline": plain["bytes_up_per_client_round"],
            "unit": "bytes",
            "ratio": run["bytes_up_per_client_round"] / plain["bytes_up_per_client_round"],
            "target": "",
        }
    labelled = (("plain", plain), ("secure, 10% dropouts", secured), ("secure + DP", dp))
    for label, run in labelled:
        rows[f"coordinator CPU share of a round, {label}"] = {
            "ours": run["coordinator_share"],
            "baseline": 1.0,
            "unit": "share",
            "ratio": run["coordinator_share"],
            "target": "< 0.05",
        }
    for label, run in (("secure, 10% dropouts", secured), ("secure + DP", dp)):
        rows[f"coordinator CPU ms a round, {label} / plain"] = {
            "ours": run["coordinator_cpu_ms_per_round"],
            "baseline": plain["coordinator_cpu_ms_per_round"],
            "unit": "ms",
            "ratio": run["coordinator_cpu_ms_per_round"] / plain["coordinator_cpu_ms_per_round"],
            "target": "",
        }
    for n in sizes:
        rows[f"round time at {n} clients, secure / plain"] = {
            "ours": runs[f"secure_{n}"]["mean_round_s"],
            "baseline": runs[f"plain_{n}"]["mean_round_s"],
            "unit": "s",
            "ratio": runs[f"secure_{n}"]["mean_round_s"] / runs[f"plain_{n}"]["mean_round_s"],
            "target": "",
        }

    print(f"{'measure':<62}{'ours':>12}{'baseline':>12}{'ratio':>9}  {'target':<8} unit")
    for label, row in rows.items():
        print(
            f"{label:<62}{row['ours']:>12.4g}{row['baseline']:>12.4g}{row['ratio']:>9.4f}"
            f"  {row['target']:<8} {row['unit']}"
        )
    print(
        f"DP: noise multiplier {dp['dp_noise_multiplier']:.3f}, epsilon reached "
        f"{dp['dp_epsilon']:.2f} at delta {dp['dp_delta']:g} over {int(dp['rounds'])} rounds "
        f"(target {args.epsilon:g})"
    )
    peaks = [
        f"{k} {v['coordinator_peak_rss_mib']:.0f} MiB"
        for k, v in runs.items()
        if "coordinator_peak_rss_mib" in v
    ]
    print("coordinator peak memory (RSS): " + ", ".join(peaks))
    parts = {label: cpu_parts(run) for label, run in labelled}
    print(
        "coordinator CPU ms a round = its round thread (of which evaluation) + its other "
        "threads (sessions reading clients; torch's workers, if more than one): "
        + "; ".join(
            f"{label} {p['all']:.0f} = {p['round thread']:.0f} ({p['evaluation']:.0f}) + "
            f"{p['other threads']:.0f}"
            for label, p in parts.items()
        )
    )
    print(
        f"validation loss before training {plain['initial_val_loss']:.4f}; after {rounds} rounds: "
        f"plain {plain['final_val_loss']:.4f}, secure with dropouts "
        f"{secured['final_val_loss']:.4f}, secure + DP {dp['final_val_loss']:.4f}; bench "
        f"{sum(r['wall_s'] for k, r in runs.items() if k != f'plain_{most}'):.0f} s in all"
    )
    write_results(
        RESULTS,
        {"rows": rows, "cpu_parts": parts, "runs": runs, "args": vars(args)},
        machine=machine,
    )
    x = secured["final_val_loss"] / plain["final_val_loss"]
    print(
        f"{most} clients, secure aggregation with 10% dropouts / plain final validation loss: "
        f"{x:.4f}, coordinator CPU share: {secured['coordinator_share']:.4f} "
        f"({secured['coordinator_cpu_ms_per_round']:.0f} ms a round)"
    )


def cpu_parts(run: dict[str, float]) -> dict[str, float]:
    """A run's coordinator CPU ms a round, split: the thread that runs the rounds (the
    protocol, aggregation, checkpoint and evaluation), evaluation alone, and the other threads
    (the sessions reading what clients send, the listener, and torch's intra-op workers where
    the coordinator has more than one: the bench's local run gives it one)."""
    total, thread = run["coordinator_cpu_ms_per_round"], run["coordinator_thread_cpu_ms_per_round"]
    return {
        "all": total,
        "round thread": thread,
        "evaluation": run["eval_cpu_ms_per_round"],
        "other threads": total - thread,
    }


if __name__ == "__main__":
    main()
