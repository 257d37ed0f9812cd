"""A coordinator process SIGKILLed after round k and restarted with fed.resume=true.

Real processes, as a user runs them: `python -m fed_learn role=coordinator` and two
`role=client` processes. The clients outlive the crash and dial the restarted coordinator.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lab.launch import free_port
from lab.tracking import METRICS_FILE, read_records
from tests.clocks import HANG_GUARD_S

ROUNDS = 4


def fed_process(role: str, run_dir: Path, lab_cache: Path, port: int, *extra: str):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fed_learn",
            f"role={role}",
            "model.lab_preset=debug",
            "tracking.wandb=false",
            "tracking.console=false",
            f"paths.run_dir={run_dir}",
            f"paths.cache_dir={lab_cache}",
            f"hydra.run.dir={run_dir}",
            f"fed.coordinator.port={port}",
            "num_threads=1",
            "fed.num_clients=2",
            "fed.min_fit_clients=2",
            f"fed.rounds={ROUNDS}",
            "fed.local_steps=15",
            "fed.max_examples_per_client=64",
            "fed.eval_blocks=8",
            "fed.heartbeat_s=0.5",
            "fed.heartbeat_timeout_s=15",
            # the clients redial the restarted coordinator this long: a new process importing
            # torch and loading its model on a busy machine, not a speed to beat
            f"fed.wait_clients_s={HANG_GUARD_S:g}",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_for_round(latest: Path, round_number: int, procs, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if latest.is_file() and json.loads(latest.read_text())["round"] >= round_number:
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    outputs = [
        p.communicate(timeout=HANG_GUARD_S)[0] if p.poll() is not None else "" for p in procs
    ]
    pytest.fail(f"round {round_number} never completed:\n" + "\n".join(o[-3000:] for o in outputs))


def test_killed_coordinator_resumes_at_the_next_round_from_its_checkpoint(
    tiny_models: Path, lab_cache: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "coordinator"
    port = free_port("127.0.0.1")
    checkpoints = run_dir / "checkpoints"
    coordinator = fed_process("coordinator", run_dir, lab_cache, port)
    clients = [
        fed_process("client", tmp_path / f"client{i}", lab_cache, port, f"client_index={i}")
        for i in range(2)
    ]
    try:
        wait_for_round(checkpoints / "latest.json", 1, [coordinator, *clients])
        coordinator.send_signal(signal.SIGKILL)
        coordinator.communicate(timeout=HANG_GUARD_S)
        k = json.loads((checkpoints / "latest.json").read_text())["round"]
        assert 1 <= k < ROUNDS, "the crash must leave rounds to do"
        folder = checkpoints / f"round_{k:04d}"
        saved_bytes = (folder / "adapter_model.safetensors").read_bytes()
        saved_loss = json.loads((folder / "fed_state.json").read_text())["metrics"]["val_loss"]
        metrics_file = run_dir / METRICS_FILE
        # The crash's worst moment, made certain: round k checkpointed, its log line not written
        # (a kill between the two; the multihost fault test once landed there). Its row goes.
        kept = [r for r in read_records(metrics_file) if r.get("step") != k]
        metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))
        before_restart = len(kept)

        restarted = fed_process("coordinator", run_dir, lab_cache, port, "fed.resume=true")
        out, _ = restarted.communicate(timeout=HANG_GUARD_S)
        assert restarted.returncode == 0, out[-3000:]
        for client in clients:  # they waited through the crash and finished with it
            client_out, _ = client.communicate(timeout=HANG_GUARD_S)
            assert client.returncode == 0, client_out[-3000:]
            assert "lost the coordinator" in client_out
    finally:
        for proc in [coordinator, *clients]:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    # "resumed from .../round_000k (round k): validation loss X, saved Y": the restart's first
    # evaluation, before any training, is of the adapter it loaded, on the same held-out text
    resumed = re.search(rf"\(round {k}\): validation loss ([\d.]+), saved ([\d.]+)", out)
    assert resumed, out[-3000:]
    assert float(resumed.group(1)) == pytest.approx(saved_loss, abs=1e-5)
    everything = read_records(metrics_file)
    steps = [line for line in everything[before_restart:] if line.get("kind") == "metrics"]
    # Round k's row from its checkpoint (not trained again: its saved figures), then rounds
    # k+1 .. ROUNDS, nothing before k+1 redone, and no round logged twice
    assert [s["step"] for s in steps] == list(range(k, ROUNDS + 1))
    assert steps[0]["val_loss"] == saved_loss
    assert f"round {k}: checkpointed but not logged before the stop: logged now" in out
    logged = [line["step"] for line in everything if line.get("kind") == "metrics"]
    assert sorted(logged) == list(range(ROUNDS + 1))  # step 0: the loss before round 1
    # the final metrics are the whole run's, not the resumed part's
    (summary,) = [line for line in everything if line.get("kind") == "summary"]
    assert summary["rounds"] == ROUNDS
    initial = next(line for line in everything if line.get("step") == 0)["val_loss"]
    assert summary["initial_val_loss"] == pytest.approx(initial)
    assert json.loads((checkpoints / "latest.json").read_text())["round"] == ROUNDS
    assert (folder / "adapter_model.safetensors").read_bytes() == saved_bytes
    final = load_file(str(checkpoints / f"round_{ROUNDS:04d}" / "adapter_model.safetensors"))
    restored = load_file(str(folder / "adapter_model.safetensors"))
    assert any(not final[name].equal(restored[name]) for name in final)  # it trained on
