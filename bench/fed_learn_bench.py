"""Federated LoRA: what crosses the network and what federation costs in quality, in one run.

Three local federations (`python -m fed_learn`'s set-up: a coordinator and 3 client processes
on loopback, tiny_target base, non-IID shards of the stdlib test suite the base never saw),
identical but for `fed.compression`, then:

1. bytes a client sends per round: the full model's weights (the netproto frame they would
   take, encoded for real) vs the LoRA adapter (measured on the sockets) - target: the adapter
   at most 1/100; the same ratio is computed for TinyLlama-1.1B's shapes (PEFT on a meta-device
   model: no weights needed) since a 1 M-parameter model is mostly what LoRA wraps;
2. topk and topk_int8 updates vs plain adapters: bytes and final validation loss - target:
   topk_int8 at least 10x fewer bytes with the final loss within 2%;
3. federated vs centralized (the same model trained on all clients' data pooled, same steps):
   final validation loss - target: within 5%;
4. the coordinator's own time (sending, aggregating, evaluating, checkpointing) as a share of
   the round - target: under 5%.

5. heterogeneous clients (`fed.partition=file_type`: one client holds the stdlib test suite's
   .py files, one its .decTest files, one its other text files; 3 clients simulated in one
   process, the debug model), measured by federated evaluation on the clients' own held-out
   shards: FedAdam's server_lr, then its tau, chosen on the grid {1e-3, 3e-3, 1e-2, 3e-2, 1e-1}
   with seed 0 (tau at 1e-3 while server_lr is chosen), then FedAvg, FedProx and FedAdam with
   seeds 1-3 - target: FedAdam's mean client-evaluated loss at round R at most FedAvg's.

Prints the tables, writes bench/results/fed_learn_bench.json and fed_learn_heterogeneous.json
(+ .png), and ends with `client-evaluated loss at round R, FedAdam / FedAvg: Q`. `--quick` runs
the debug models for 2 short rounds; `--heterogeneous-only` runs part 5 alone.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from lab.config import CONF_DIR
from lab.machine import announce_machine, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "fed_learn_bench.json"
HETEROGENEOUS = RESULTS.with_name("fed_learn_heterogeneous.json")
GRID = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
"""Where FedAdam's server_lr and tau are chosen (Reddi et al. 2021 tune on such grids)."""
TUNING_SEED, SEEDS = 0, (1, 2, 3)
METHODS = {
    "FedAvg": ["fed.strategy=fedavg"],
    "FedProx": ["fed.strategy=fedprox"],
    "FedAdam": ["fed.strategy=fedavg", "fed.server_optimizer=adam"],
}
RUNS = Path("outputs/bench/fed_learn")

TINYLLAMA: dict[str, Any] = {  # TinyLlama/TinyLlama-1.1B-Chat-v1.0's config.json (the shapes only)
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}


def settings(name: str, overrides: list[str], runs: Path = RUNS) -> Any:
    """`conf/fed_learn.yaml` with `overrides`, as Hydra composes it, run in runs/name."""
    from lab import registry
    from lab.config import to_settings

    schema = registry.manifest("fed_learn").load_schema()  # registered for `compose`
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="fed_learn",
            overrides=[
                f"paths.run_dir={(runs / name).resolve()}",
                "tracking.wandb=false",
                "tracking.console=false",
                *overrides,
            ],
        )
    return to_settings(cfg, schema)


def federate(name: str, overrides: list[str], runs: Path = RUNS) -> dict[str, float]:
    """`python -m fed_learn <overrides>`'s `run`, in this process (its roles are processes);
    its metrics and `wall_s`, the seconds it took."""
    from fed_learn.run import run

    shutil.rmtree(runs / name, ignore_errors=True)  # metrics.jsonl appends: one run per folder
    started = time.perf_counter()
    metrics = run(settings(name, overrides, runs))
    metrics["wall_s"] = time.perf_counter() - started
    print(f"{name}: {metrics['wall_s']:.0f}s", file=sys.stderr)
    return metrics


def frame_bytes(tensors: dict[str, Any]) -> int:
    """Size of the netproto UPDATE frame that would carry `tensors` (encoded, not sent)."""
    from fed_learn.protocol import FedMsg
    from netproto import REGISTRY
    from netproto.codecs import encode
    from netproto.header import Limits, Message

    buffers = encode(
        Message(FedMsg.UPDATE, tensors, 0, 0),
        limits=Limits(max_frame_bytes=2**62),
        registry=REGISTRY,
    )
    return sum(memoryview(b).nbytes for b in buffers)


def tiny_full_weights_bytes(overrides: list[str]) -> tuple[int, int]:
    """(full-weights frame bytes, adapter parameter count) for the bench's base model."""
    from fed_learn.lora import adapter_state, peft_model

    config = settings("sizes", overrides)
    model = peft_model(config.model, config.lora, cache_dir=config.paths.cache_path)
    full = {k: v for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    return frame_bytes(full), sum(t.numel() for t in adapter_state(model).values())


def tinyllama_ratio(overrides: list[str]) -> dict[str, float]:
    """Adapter / full parameters for TinyLlama-1.1B's shapes with the bench's LoRA settings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    lora = settings("sizes", overrides).lora
    with torch.device("meta"):  # shapes only: no weights are allocated or downloaded
        base = LlamaForCausalLM(LlamaConfig(**TINYLLAMA))
    full = sum(p.numel() for p in base.parameters())
    model = get_peft_model(
        base,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return {"full_params": float(full), "adapter_params": float(adapter)}


def heterogeneous(rounds: int, machine: Any) -> float:
    """Part 5 (see the module): prints the grid and the methods' table, writes the JSON and the
    figure; returns FedAdam / FedAvg mean client-evaluated loss at round `rounds`."""
    import statistics

    common = [
        "model.lab_preset=debug",
        "fed.num_clients=3",
        "fed.simulate=3",
        "fed.partition=file_type",
        f"fed.rounds={rounds}",
        "fed.local_steps=8",
        "fed.max_examples_per_client=64",
        "fed.eval_blocks=8",
        "fed.centralized_baseline=false",
        "fed.evaluate_on_clients=true",
    ]
    runs: dict[str, dict[str, float]] = {}

    def loss(name: str, overrides: list[str]) -> float:
        runs[name] = federate(f"hetero/{name}", [*common, *overrides])
        return runs[name]["final_client_eval_loss"]

    adam = METHODS["FedAdam"]
    seed0 = f"seed={TUNING_SEED}"
    lr_grid = {
        lr: loss(f"adam_lr{lr:g}_tau0.001_s0", [*adam, seed0, f"fed.server_lr={lr}"]) for lr in GRID
    }
    best_lr = min(lr_grid, key=lr_grid.__getitem__)
    tau_grid = {
        tau: lr_grid[best_lr]
        if tau == 1e-3
        else loss(
            f"adam_lr{best_lr:g}_tau{tau:g}_s0",
            [*adam, seed0, f"fed.server_lr={best_lr}", f"fed.server_tau={tau}"],
        )
        for tau in GRID
    }
    best_tau = min(tau_grid, key=tau_grid.__getitem__)
    tuned = [f"fed.server_lr={best_lr}", f"fed.server_tau={best_tau}"]
    chosen: dict[str, list[str]] = {"FedAvg": [], "FedProx": [], "FedAdam": tuned}
    losses: dict[str, list[float]] = {m: [] for m in METHODS}
    for seed in SEEDS:
        for method, overrides in METHODS.items():
            name = f"{method}_s{seed}"
            losses[method].append(loss(name, [*overrides, *chosen[method], f"seed={seed}"]))
    curves = {
        method: [read_client_eval(RUNS / "hetero" / f"{method}_s{seed}") for seed in SEEDS]
        for method in METHODS
    }

    print(f"\nheterogeneous clients (file types), client-evaluated loss at round {rounds}")
    print(f"FedAdam tuning, seed {TUNING_SEED}: server_lr (tau 1e-3), then tau ({best_lr:g})")
    print("  " + "".join(f"{v:>10g}" for v in GRID))
    print("lr" + "".join(f"{lr_grid[v]:>10.4f}" for v in GRID))
    print("tau" + "".join(f"{tau_grid[v]:>10.4f}" for v in GRID)[1:])
    print(f"chosen: server_lr={best_lr:g}, tau={best_tau:g}")
    seeds = "".join(f"{'seed ' + str(s):>10}" for s in SEEDS)
    print(f"{'method':<10}{seeds}{'mean':>10}{'std':>8}")
    for method, values in losses.items():
        row = "".join(f"{v:>10.4f}" for v in values)
        mean, std = statistics.mean(values), statistics.pstdev(values)
        print(f"{method:<10}{row}{mean:>10.4f}{std:>8.4f}")
    ratio = statistics.mean(losses["FedAdam"]) / statistics.mean(losses["FedAvg"])
    verdict = "met" if ratio <= 1.0 else "missed"
    print(f"FedAdam / FedAvg mean client-evaluated loss: {ratio:.4f} (target <= 1.0: {verdict})")
    write_results(
        HETEROGENEOUS,
        {
            "rounds": rounds,
            "grid": list(GRID),
            "server_lr_grid": {f"{k:g}": v for k, v in lr_grid.items()},
            "tau_grid": {f"{k:g}": v for k, v in tau_grid.items()},
            "chosen": {"server_lr": best_lr, "server_tau": best_tau},
            "losses": losses,
            "curves": curves,
            "ratio_fedadam_over_fedavg": ratio,
            "target": "<= 1.0",
            "verdict": verdict,
            "runs": runs,
        },
        machine=machine,
    )
    plot_curves(curves, HETEROGENEOUS.with_suffix(".png"))
    return ratio


def read_client_eval(run_dir: Path) -> list[float]:
    """A run's client-evaluated loss, round by round (its coordinator's metrics)."""
    from lab.tracking import METRICS_FILE, read_records

    records = read_records(run_dir / "coordinator" / METRICS_FILE)
    return [r["client_eval_loss"] for r in records if "client_eval_loss" in r]


def plot_curves(curves: dict[str, list[list[float]]], path: Path) -> None:
    """Each method's client-evaluated loss per round, mean over seeds (the band: min..max)."""
    from lab.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for method, per_seed in curves.items():
        steps = range(1, min(len(c) for c in per_seed) + 1)
        by_round = [[c[i - 1] for c in per_seed] for i in steps]
        ax.plot(steps, [sum(v) / len(v) for v in by_round], marker="o", label=method)
        ax.fill_between(steps, [min(v) for v in by_round], [max(v) for v in by_round], alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("client-evaluated loss (nats/token)")
    ax.set_title("heterogeneous clients (file types), seeds 1-3")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, plt, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="debug models, 2 short rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--topk-fraction", type=float, default=0.05)
    parser.add_argument("--heterogeneous-only", action="store_true", help="part 5 alone")
    parser.add_argument("--heterogeneous-rounds", type=int, default=5)
    args = parser.parse_args()
    machine = announce_machine()
    if not args.heterogeneous_only:
        compression_and_cost(args, machine)
    rounds = 2 if args.quick else args.heterogeneous_rounds
    ratio = heterogeneous(rounds, machine)
    print(f"client-evaluated loss at round {rounds}, FedAdam / FedAvg: {ratio:.3f}")


def compression_and_cost(args: argparse.Namespace, machine: Any) -> None:
    """Parts 1-4 (see the module)."""

    common = [
        f"fed.rounds={2 if args.quick else args.rounds}",
        "fed.num_clients=3",
        f"fed.topk_fraction={args.topk_fraction}",
    ]
    if args.quick:
        common += ["model.lab_preset=debug", "fed.local_steps=10", "fed.max_examples_per_client=64"]
    runs = {
        method: federate(
            method,
            [
                *common,
                f"fed.compression={method}",
                f"fed.centralized_baseline={str(method == 'none').lower()}",
            ],
        )
        for method in ("none", "topk", "topk_int8")
    }
    plain = runs["none"]
    full_bytes, tiny_adapter_params = tiny_full_weights_bytes(common)
    rows: dict[str, dict[str, Any]] = {}
    rows["adapter / full weights, tiny_target (sent)"] = {
        "ours": plain["bytes_up_per_client_round"],
        "baseline": float(full_bytes),
        "unit": "bytes up per client per round",
        "ratio": plain["bytes_up_per_client_round"] / full_bytes,
        "target": "<= 0.01",
    }
    big = tinyllama_ratio(common)
    rows["adapter / full weights, TinyLlama-1.1B shapes"] = {
        "ours": big["adapter_params"],
        "baseline": big["full_params"],
        "unit": "parameters (computed)",
        "ratio": big["adapter_params"] / big["full_params"],
        "target": "<= 0.01",
    }
    for method in ("topk", "topk_int8"):
        run = runs[method]
        rows[f"{method}: plain adapter / {method} bytes"] = {
            "ours": run["bytes_up_per_client_round"],
            "baseline": plain["bytes_up_per_client_round"],
            "unit": "bytes up per client per round",
            "ratio": plain["bytes_up_per_client_round"] / run["bytes_up_per_client_round"],
            "target": ">= 10" if method == "topk_int8" else "",
        }
        rows[f"{method}: final val loss / plain's"] = {
            "ours": run["final_val_loss"],
            "baseline": plain["final_val_loss"],
            "unit": "validation loss",
            "ratio": run["final_val_loss"] / plain["final_val_loss"],
            "target": "<= 1.02" if method == "topk_int8" else "",
        }
    rows["federated / centralized final val loss"] = {
        "ours": plain["final_val_loss"],
        "baseline": plain["centralized_val_loss"],
        "unit": "validation loss",
        "ratio": plain["federated_over_centralized"],
        "target": "<= 1.05",
    }
    worst = max(runs, key=lambda m: runs[m]["coordinator_share"])
    rows[f"coordinator share of the round (worst: {worst})"] = {
        "ours": runs[worst]["coordinator_share"],
        "baseline": 1.0,
        "unit": "share",
        "ratio": runs[worst]["coordinator_share"],
        "target": "< 0.05",
    }

    print(f"{'measure':<52}{'ours':>12}{'baseline':>14}{'ratio':>9}  {'target':<8} unit")
    for label, row in rows.items():
        print(
            f"{label:<52}{row['ours']:>12.4g}{row['baseline']:>14.4g}{row['ratio']:>9.4f}"
            f"  {row['target']:<8} {row['unit']}"
        )
    print(
        "validation loss before training {:.4f}; after {} rounds: none {:.4f}, topk {:.4f}, "
        "topk_int8 {:.4f}, centralized {:.4f}".format(
            plain["initial_val_loss"],
            int(plain["rounds"]),
            plain["final_val_loss"],
            runs["topk"]["final_val_loss"],
            runs["topk_int8"]["final_val_loss"],
            plain["centralized_val_loss"],
        )
    )
    print(f"tiny_target adapter: {tiny_adapter_params} parameters")
    write_results(
        RESULTS,
        {"rows": rows, "runs": runs, "quick": args.quick, "args": vars(args)},
        machine=machine,
    )
    print(
        f"federated / centralized final validation loss: {plain['federated_over_centralized']:.3f}"
    )


if __name__ == "__main__":
    main()
