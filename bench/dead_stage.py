"""How long a split_training run takes to end once a stage is SIGKILLed mid-run (issue 48: the
target is 10 s from the kill to the last process of the run gone, locally and across hosts).

    python bench/dead_stage.py                # a local run (`role=local`), each stage in turn
    python bench/dead_stage.py --hosts        # also across namespace hosts (root, WireGuard)

Every wait of the run is set to 600 s (`split.rpc_timeout_s`), so only the liveness checks
(the launcher's watch of its stage processes, the heartbeats) can end it in time. Prints one
row per kill, the error line the run ended with, and the slowest time last.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = [
    "model.lab_preset=debug", "tracking.wandb=false", "split.steps=400",
    "split.checkpoint_every=1", "split.eval_every=0", "split.batch_size=4",
    "split.microbatches=2", "split.block_size=16", "split.max_train_blocks=64",
    "split.rpc_timeout_s=600",
]  # fmt: skip
TARGET_S = 10.0


def _wait_for(path: Path, alive: Callable[[], bool], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if not alive() or time.monotonic() > deadline:
            raise SystemExit(f"the run ended or stalled before its first checkpoint ({path})")
        time.sleep(0.1)
    time.sleep(1.0)  # into the next steps


def _all_gone(processes: list[psutil.Process], timeout_s: float) -> float:
    """Seconds until none of `processes` runs (a zombie counts as gone)."""
    started = time.monotonic()
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.wait(timeout=max(0.0, timeout_s - (time.monotonic() - started)))
    return time.monotonic() - started


def _error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("error: ")]
    return lines[-1][:160] if lines else "(no error line)"


def on_loopback(out: Path, rank: int) -> tuple[float, str]:
    """`python -m split_training` (every role on this machine); SIGKILL stage `rank`."""
    run_dir = out / f"loopback-stage{rank}"
    log = out / f"loopback-stage{rank}.log"
    argv = [sys.executable, "-m", "split_training", *SETTINGS, f"hydra.run.dir={run_dir}"]
    with log.open("w") as sink:
        launcher = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        _wait_for(run_dir / "checkpoints" / "latest.json", lambda: launcher.poll() is None)
        tree = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(True)]
        victim = next(p for p in tree if f"split.rank={rank}" in p.cmdline())
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        _all_gone([p for p in tree if p.pid != victim.pid], timeout_s=120)
        return time.monotonic() - killed, _error_line(log.read_text())
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait()


def across_hosts(out: Path, rank: int) -> tuple[float, str]:
    """The driver and each stage on a namespace host of its own, in the lab's overlay;
    stage `rank`'s host loses power (its processes SIGKILLed, its overlay with them)."""
    from lab import registry
    from labtools.hosts import Network
    from labtools.hosts.scenarios import Roles, Security, provision

    scenario = registry.manifest("split_training").scenario
    assert scenario is not None
    scenario = replace(scenario, common=[*scenario.common, *SETTINGS[1:]])
    folder = out / f"hosts-stage{rank}"
    with Network(list(scenario.hosts), root=folder / "hosts") as network:
        provision(network, log=open(os.devnull, "w"))  # noqa: SIM115 - for the run's length
        roles = Roles(network, scenario, Security(secret=secrets.token_hex(16)), folder)
        for _, role, _ in scenario.roles:
            roles.start(role)
        latest = roles.run_dir("driver") / "checkpoints" / "latest.json"
        _wait_for(latest, lambda: all(p.poll() is None for p in roles.procs.values()))
        victim = f"stage{rank}"
        others = [psutil.Process(p.pid) for name, p in roles.procs.items() if name != victim]
        processes = [q for p in others for q in (p, *p.children(recursive=True))]
        killed = time.monotonic()
        roles.kill(victim)
        _all_gone(processes, timeout_s=120)
        elapsed = time.monotonic() - killed
        log = folder / f"{roles.placed['driver'][0]}-driver.log"
        return elapsed, _error_line(log.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", action="store_true", help="also across namespace hosts")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="dead_stage_"))
    os.environ.setdefault("LAB_CACHE", str(out / "cache"))
    rows = []
    try:
        cases: list[tuple[str, Callable[[Path, int], tuple[float, str]]]] = [
            ("loopback", on_loopback)
        ]
        if args.hosts:
            cases.append(("across hosts", across_hosts))
        for where, measure in cases:
            for rank in (1, 2):
                seconds, error = measure(out, rank)
                rows.append(seconds)
                print(
                    f"{where:13s} stage{rank} SIGKILLed: all gone in {seconds:5.1f} s | {error}",
                    flush=True,
                )
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(
        f"slowest, SIGKILL to every process of the run gone: {max(rows):.1f} s "
        f"(target {TARGET_S:g} s)"
    )


if __name__ == "__main__":
    main()
