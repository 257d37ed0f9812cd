"""What the overlay costs a split run: the same run across hosts inside the lab's WireGuard
overlay and on the plain network (`cluster.unsafe_plain_network=true`), side by side.

Run: `python bench/overlay_bench.py [--repeats N] [--rate 100mbit]` (root; wireguard-tools,
nftables and the kernel's WireGuard or wireguard-go, e.g. `make multihost-deps`).

Three network namespaces on this machine (labtools.hosts): the driver on one, a stage on each of the
others, the tiny debug model; split_inference's per-token latency (p50, KV cache on) and
split_training's step time (median), each variant run `--repeats` times in alternation (plain,
overlay, plain, ...) and the median kept. Every host shares this machine's cores, so
wireguard-go's encryption competes with the stages for them, as it would on a real host of
the same size. Prints a table, writes bench/results/overlay_bench.json, and ends with the
worse of the two ratios overlay / plain.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from lab.machine import announce_machine, write_results
from lab.records import step_metrics
from labtools.hosts import Network, Security, provision, run_across, scenarios
from world.overlay import unavailable as overlay_unavailable

RESULTS = Path(__file__).resolve().parent / "results" / "overlay_bench.json"
VARIANTS = {"plain": "cluster.unsafe_plain_network=true", "overlay": "cluster.overlay.up=true"}
MEASURES = {
    "split_inference": ("token_ms_p50", "ms per token (p50)", ["generate.kv_cache=true",
                        "generate.num_prompts=4", "generate.max_new_tokens=48"]),
    "split_training": ("step_s", "ms per training step (median)", ["split.steps=60"]),
}  # fmt: skip


def measure(run_dir: Path, key: str) -> float:
    values = [float(r[key]) for r in step_metrics(run_dir) if isinstance(r.get(key), int | float)]
    if not values:
        raise RuntimeError(f"no {key} in {run_dir}")
    if key == "step_s":
        return statistics.median(values[5:] or values) * 1000.0  # past the first steps' warm-up
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default=None, help="cap each host's link (tc rate: 100mbit)")
    args = parser.parse_args()
    why = overlay_unavailable()
    if why is not None:
        print(f"overlay bench skipped: {why}")
        sys.exit(0)
    machine = announce_machine()
    chosen = scenarios()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="overlay-bench-") as scratch:
        out = Path(scratch)
        with Network(["desktop", "laptop", "pc"], rate=args.rate, root=out / "hosts") as network:
            provision(network, log=sys.stdout)
            security = Security(secret=secrets.token_hex(16))
            for module, (key, label, extra) in MEASURES.items():
                base = chosen[module]
                replaced = {o.split("=")[0] for o in extra} | {"cluster.overlay.up"}
                common = [o for o in base.common if o.split("=")[0] not in replaced]
                samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
                for repeat in range(args.repeats):
                    for name, override in VARIANTS.items():
                        scenario = replace(base, common=[*common, *extra, override])
                        folder = out / module / f"{name}{repeat}"
                        run_dir, _ = run_across(network, scenario, security, folder, timeout_s=600)
                        samples[name].append(measure(run_dir, key))
                        print(f"{module} {name} #{repeat + 1}: {samples[name][-1]:.2f} {label}",
                              flush=True)  # fmt: skip
                plain, overlay = (statistics.median(samples[n]) for n in VARIANTS)
                rows[module] = {"measure": label, "plain": plain, "overlay": overlay,
                                "ratio": overlay / plain, "samples": samples}  # fmt: skip
    print(f"\n{'module':<18}{'measure':<32}{'plain':>9}{'overlay':>9}{'ratio':>7}")
    for module, row in rows.items():
        print(f"{module:<18}{row['measure']:<32}{row['plain']:>9.2f}{row['overlay']:>9.2f}"
              f"{row['ratio']:>7.2f}")  # fmt: skip
    write_results(RESULTS, {"rows": rows, "repeats": args.repeats, "rate": args.rate},
                  machine=machine)  # fmt: skip
    worst = max(rows.values(), key=lambda row: float(row["ratio"]))
    print(f"overlay / plain network, worse of the two: {float(worst['ratio']):.2f}x")


if __name__ == "__main__":
    main()
