"""The one-way link delays a split-training step waits for, measured across hosts.

Run: `python bench/split_delays.py [--delay-ms 50] [--steps 12] [--same-runs 1]` (root; network
namespaces, wireguard-tools, nftables and the kernel's WireGuard or wireguard-go, e.g. `make
multihost-deps`).

Host namespaces on this machine (labtools.hosts), every packet between them held `--delay-ms`
one way by the harness's router: the driver on a host of its own, one stage per other host,
inside the lab's WireGuard overlay, a random-init 4-layer Llama (the debug tokenizer, hidden
64: compute is small beside the delays). For 2 and 3 stages and each schedule, split training
runs at 0 ms and at `--delay-ms`; the step's extra time over the delay (median step, the first
two left out) is the number of one-way delays a step really waits for, set beside the cost
model's count from the code path (`split_training.manifest.crossings`). Each run's losses are
compared with the same training on one host's loopback (`role=local`): across hosts they must
equal it within a relative 1e-6 (`--same-runs N` repeats the 2-stage 0 ms run N times more for
that check alone). Prints a table, writes bench/results/split_delays.json, and ends with
`split training one-way delays per step (2 stages): N`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from lab.machine import announce_machine, write_results
from lab.records import step_metrics
from labtools.hosts import HostsError, Network, Security, provision, run_across, scenarios
from labtools.hosts.scenarios import run_loopback
from split_training.manifest import crossings
from world.overlay import unavailable as overlay_unavailable

RESULTS = Path(__file__).resolve().parent / "results" / "split_delays.json"
HOSTS = ["desktop", "laptop", "pc", "server"]
SCHEDULES = ("gpipe", "1f1b")


def build_model(cache: Path, folder: Path) -> Path:
    """A random-init 4-layer Llama with the debug preset's tokenizer (3 stages need 3 layers;
    the debug model has 2), as every host loads it from one folder."""
    import torch
    from transformers import AutoTokenizer

    from lab.pretrain import TinyModelSpec, build_llama, ensure_tiny_models, load_preset

    tiny = ensure_tiny_models(load_preset("debug"), cache)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "tiny_target")
    torch.manual_seed(0)
    spec = TinyModelSpec(num_layers=4, hidden_size=64, num_heads=2, intermediate_size=128)
    model = build_llama(spec, vocab_size=len(tokenizer), context_length=256, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def step_ms(run_dir: Path) -> float:
    steps = [float(r["step_s"]) for r in step_metrics(run_dir) if "step_s" in r]
    if len(steps) < 4:
        raise RuntimeError(f"{len(steps)} steps in {run_dir}: too few to measure")
    return 1e3 * statistics.median(steps[2:])


def losses(run_dir: Path) -> list[float]:
    return [float(r["loss"]) for r in step_metrics(run_dir) if "loss" in r]


def worst_relative(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def loopback(network: Network, scenario: Any, out: Path) -> Path:
    """The same training as one `role=local` run on the first host's loopback (no overlay:
    nothing crosses a link); its log's end where it fails."""
    local = replace(scenario, common=[o for o in scenario.common if "overlay" not in o])
    try:
        return run_loopback(network, local, out / "loopback", timeout_s=600)
    except HostsError:
        log = out / "loopback" / "loopback.log"
        print(log.read_text()[-3000:] if log.is_file() else f"no log at {log}", file=sys.stderr)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--same-runs", type=int, default=1, help="extra 2-stage runs at 0 ms compared with loopback"
    )
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args()
    why = overlay_unavailable()
    if why is not None:
        print(f"split delays bench skipped: {why}")
        sys.exit(0)
    machine = announce_machine()
    base = scenarios()["split_training"]
    stage_counts = [int(s) for s in args.stages.split(",")]
    schedules = args.schedules.split(",")
    rows: list[dict[str, Any]] = []
    same: list[float] = []
    with tempfile.TemporaryDirectory(prefix="split-delays-") as scratch:
        out = Path(scratch)
        with Network(HOSTS[: max(stage_counts) + 1], delay_ms=0, root=out / "hosts") as network:
            provision(network, log=sys.stdout)
            first = next(iter(network.hosts.values()))
            model = build_model(first.cache, out / "model")
            security = Security(secret=secrets.token_hex(16))
            for stages in stage_counts:
                roles = [("desktop", "driver", ["role=driver"])] + [
                    (HOSTS[rank], f"stage{rank}", ["role=stage", f"split.rank={rank}"])
                    for rank in range(1, stages + 1)
                ]
                for schedule in schedules:
                    settings = [
                        *(
                            o
                            for o in base.common
                            if not o.startswith(("split.num_stages", "model.lab_preset"))
                        ),
                        f"model.pretrained={model}",
                        f"split.num_stages={stages}",
                        f"split.steps={args.steps}",
                        f"split.schedule={schedule}",
                        "split.eval_every=0",
                        "split.max_train_blocks=256",
                    ]
                    scenario = replace(base, roles=roles, common=settings)
                    label = f"{stages}-stages-{schedule}"
                    network.set_link(delay_ms=0, rate=None)
                    local = losses(loopback(network, scenario, out / label))
                    measured: dict[float, float] = {}
                    drift = 0.0
                    for delay in (0.0, args.delay_ms):
                        network.set_link(delay_ms=delay, rate=None)
                        run_dir, _ = run_across(
                            network, scenario, security, out / label / f"{delay:g}ms", timeout_s=900
                        )
                        measured[delay] = step_ms(run_dir)
                        drift = max(drift, worst_relative(losses(run_dir), local))
                        print(
                            f"{label}, {delay:g} ms one way: step {measured[delay]:.1f} ms, "
                            f"losses vs loopback {drift:.1e}",
                            flush=True,
                        )
                    if stages == 2 and schedule == schedules[0]:
                        network.set_link(delay_ms=0, rate=None)
                        for repeat in range(args.same_runs):
                            run_dir, _ = run_across(
                                network,
                                scenario,
                                security,
                                out / label / f"same{repeat}",
                                timeout_s=900,
                            )
                            same.append(worst_relative(losses(run_dir), local))
                            print(
                                f"{label}, same run #{repeat + 1}: losses vs loopback "
                                f"{same[-1]:.1e}",
                                flush=True,
                            )
                    extra = measured[args.delay_ms] - measured[0.0]
                    rows.append(
                        {
                            "stages": stages,
                            "schedule": schedule,
                            "step_ms_0": measured[0.0],
                            f"step_ms_{args.delay_ms:g}": measured[args.delay_ms],
                            "delays_per_step": extra / args.delay_ms,
                            "model_count": crossings(stages, schedule=schedule, microbatches=4),
                            "losses_vs_loopback": drift,
                        }
                    )
    delayed = f"step @{args.delay_ms:g}"
    print(
        f"\n{'stages':>6}  {'schedule':<8}{'step @0':>10}{delayed:>10}"
        f"{'delays':>8}{'model':>7}{'vs loopback':>13}"
    )
    for row in rows:
        print(
            f"{row['stages']:>6}  {row['schedule']:<8}{row['step_ms_0']:>8.1f}ms"
            f"{row[f'step_ms_{args.delay_ms:g}']:>8.1f}ms{row['delays_per_step']:>8.2f}"
            f"{row['model_count']:>7.1f}{row['losses_vs_loopback']:>13.1e}"
        )
    if same:
        within = sum(value <= 1e-6 for value in same)
        print(f"2-stage runs across hosts equal to loopback within 1e-6: {within} of {len(same)}")
    write_results(
        RESULTS,
        {"rows": rows, "same_runs": same, "delay_ms": args.delay_ms, "steps": args.steps},
        machine=machine,
    )
    print(json.dumps({"results": str(RESULTS)}))
    two = [r for r in rows if r["stages"] == 2 and r["schedule"] == schedules[0]]
    if two:
        print(f"split training one-way delays per step (2 stages): {two[0]['delays_per_step']:.1f}")


if __name__ == "__main__":
    main()
