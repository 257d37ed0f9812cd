"""run_matrix's cells as Ray tasks on a two-node Ray cluster: a head node in one namespace host, a
second node in another, token authentication on (`pip install -e .[ray]`, `make ray-deps`).

Marked `slow` too: the Ray extra is large and not in the default install, where this skips,
saying why. `ray stop` stops every Ray process of the machine, so this also skips when a Ray
node is already running here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from labtools.hosts.network import Host, Network
from tests.clocks import HANG_GUARD_S

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

RAY = Path(sys.executable).parent / "ray"
SWEEP = [
    "grid.context=[8,16]",
    "grid.batch=[1,2]",
    'overrides=["model.lab_preset=debug","generate.max_new_tokens=4"]',
    "repeats=1",
    "timeout_s=400",
]
"""A 2x2 split_inference sweep on the debug model: four cells, each a 3-process run."""


TEMP_DIRS: list[Path] = []
"""The Ray nodes' session folders, removed after the test."""


def _missing() -> str | None:
    for module in ("ray", "hydra_plugins.hydra_ray_launcher"):
        if importlib.util.find_spec(module.split(".")[0]) is None or (
            "." in module and importlib.util.find_spec(module) is None
        ):
            return f"{module} is not installed: `make ray-deps` (pip install -e .[ray])"
    if not RAY.exists():
        return f"no `ray` command beside {sys.executable}"
    running = [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"]
    if running:
        return (
            f"a Ray node already runs on this machine (raylet {running}): `ray stop` would end it"
        )
    return None


@pytest.fixture
def ray_env(tmp_path: Path) -> dict[str, str]:
    """Token authentication for every node and driver: the token in a 0600 file."""
    why = _missing()
    if why:
        pytest.skip(why)
    token = tmp_path / "ray_token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "LAB_CACHE": os.environ.get("LAB_CACHE", str(tmp_path / "cache")),
        "WANDB_MODE": "offline",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def _env(env: dict[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())]


def _ray_start(host: Host, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`ray start` in the host's namespace (it returns once its daemons run), its session in a
    folder of its own with a short path (Ray's unix sockets live there: at most 107 bytes)."""
    temp = Path(tempfile.mkdtemp(prefix=f"lab-ray-{host.name}-"))
    TEMP_DIRS.append(temp)
    argv = [*_env(env), str(RAY), "start", f"--node-ip-address={host.address}", "--num-cpus=1",
            "--object-store-memory=100000000", "--disable-usage-stats", f"--temp-dir={temp}",
            *args]  # fmt: skip
    return subprocess.run(
        ["ip", "netns", "exec", host.netns, *argv],
        env=host.env(),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


def _sweep(
    host: Host, env: dict[str, str], out_dir: Path, head: str, log: Path
) -> subprocess.Popen:
    argv = [*_env(env), sys.executable, "run_matrix.py", "hydra/launcher=ray"]
    argv += [f"hydra.launcher.ray.init.address={head}:6379", *SWEEP, f"out_dir={out_dir}"]
    return host.start(argv, log)


def _records(out_dir: Path) -> list[dict]:
    path = out_dir / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cells_running(out_dir: Path) -> list[str]:
    """Processes of the sweep's cells (their command lines name the sweep's folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(out_dir / "cells") in cmdline:
            found.append(cmdline)
    return found


def test_a_sweeps_cells_run_as_ray_tasks_on_two_nodes_resume_and_stop_on_ctrl_c(
    tmp_path: Path, ray_env: dict[str, str]
) -> None:
    out_dir = tmp_path / "sweep"
    with Network(["head", "node", "stranger"], root=tmp_path / "hosts") as net:
        head, node, stranger = (net.hosts[n] for n in ("head", "node", "stranger"))
        try:
            started = _ray_start(
                head, ray_env, "--head", "--port=6379", "--include-dashboard=false"
            )
            assert started.returncode == 0, started.stdout + started.stderr
            joined = _ray_start(node, ray_env, f"--address={head.address}:6379")
            assert joined.returncode == 0, joined.stdout + joined.stderr
            # the attacks: a stranger without the token, or with a wrong one, cannot join
            # (a node joins with the token: the arm above shows the same command can succeed)
            no_token = {k: v for k, v in ray_env.items() if not k.startswith("RAY_AUTH_TOKEN")}
            wrong = tmp_path / "wrong_token"
            wrong.touch(mode=0o600)
            wrong.write_text(secrets.token_hex(32))
            for env in (no_token, {**ray_env, "RAY_AUTH_TOKEN_PATH": str(wrong)}):
                refused = _ray_start(stranger, env, f"--address={head.address}:6379",
                                     "--block")  # fmt: skip
                assert refused.returncode != 0, refused.stdout + refused.stderr
            nodes = head.run([*_env(ray_env), sys.executable, "-c",
                              "import ray; ray.init(address='auto', logging_level='ERROR'); "
                              "print(sorted(n['NodeManagerAddress'] for n in ray.nodes() "
                              "if n['Alive']))"])  # fmt: skip
            assert nodes.strip().splitlines()[-1] == str(sorted([head.address, node.address]))

            # Ctrl-C once the first cell is in: the sweep stops, its cells with it
            proc = _sweep(head, ray_env, out_dir, head.address, tmp_path / "first.log")
            deadline = time.monotonic() + 900
            while not _records(out_dir) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1)
            assert _records(out_dir), (tmp_path / "first.log").read_text()[-3000:]
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=180) != 0
            first = (tmp_path / "first.log").read_text()
            assert "interrupted; the cells done are kept" in first, first[-3000:]
            gone_by = time.monotonic() + 60
            while _cells_running(out_dir) and time.monotonic() < gone_by:
                time.sleep(1)
            assert not _cells_running(out_dir)
            before = {r["cell"] for r in _records(out_dir) if r["status"] == "ok"}

            # the same command goes on: only the cells not done are sent
            proc = _sweep(head, ray_env, out_dir, head.address, tmp_path / "second.log")
            assert proc.wait(timeout=1200) == 0, (tmp_path / "second.log").read_text()[-3000:]
            second = (tmp_path / "second.log").read_text()
            assert f"{len(before)} already done, {4 - len(before)} handed to RayLauncher" in second
            assert second.strip().splitlines()[-1] == "cells ok: 4 of 4"
        finally:
            for host in (stranger, node, head):
                subprocess.run(
                    ["ip", "netns", "exec", host.netns, str(RAY), "stop", "--force"],
                    capture_output=True,
                    timeout=HANG_GUARD_S,
                    check=False,
                )
            for temp in TEMP_DIRS:
                shutil.rmtree(temp, ignore_errors=True)
    records = _records(out_dir)
    ok = [r for r in records if r["status"] == "ok"]
    assert sorted(r["cell"] for r in ok) == sorted({r["cell"] for r in ok})  # none ran twice
    assert len(ok) == 4
    ran_on = {r["machine"]["node"] for r in ok}
    assert any(head.address in n for n in ran_on) and any(node.address in n for n in ran_on), ran_on
    # the same heatmaps as a sweep run here: one PNG per metric
    assert len(list((out_dir / "heatmaps").glob("*.png"))) >= 4
    shutil.rmtree(tmp_path / "hosts", ignore_errors=True)
