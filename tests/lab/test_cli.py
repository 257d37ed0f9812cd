"""How `python -m <module>` ends for a user: a problem they can fix is one line, a bug a trace."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clocks import HANG_GUARD_S


def run_module(module: str, overrides: list[str], *, tmp_path: Path, lab_cache: Path, env=None):
    return subprocess.run(
        [sys.executable, "-m", module, *overrides, f"hydra.run.dir={tmp_path}",
         f"paths.cache_dir={lab_cache}", "tracking.wandb=false"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("module", "overrides", "says"),
    [
        # range, choice and cross-section checks of the schemas
        ("fed_learn", ["fed.rounds=-1"], "fed.rounds"),
        ("fed_learn", ["fed.strategy=bogus"], "fed.strategy"),
        ("spec_decoding", ["spec.top_p=2", "target.lab_preset=debug", "draft.lab_preset=debug"],
         "spec.top_p"),
        # a model that is not there names the key the user set, not always model.pretrained
        ("split_inference", ["model.pretrained=/nonexistent"], "model.pretrained='/nonexistent'"),
        ("spec_decoding", ["draft.pretrained=/nonexistent", "target.lab_preset=debug"],
         "draft.pretrained='/nonexistent'"),
        # more stages than layers: refused from config.json, before any stage process starts
        ("split_inference", ["split.num_stages=5", "model.lab_preset=debug"],
         "split.num_stages=5 needs at least as many layers"),
        # a role told to dial port 0 (only a local run picks one)
        ("fed_learn", ["role=client", "fed.coordinator.port=0", "model.lab_preset=debug"],
         "role=client needs fed.coordinator.port"),
        # an endpoint's new key misspelt: one line naming the key it meant
        ("fed_learn", ["role=client", "fed.coordinater.port=29510"],
         "fed.coordinater.port is not a setting of fed_learn; did you mean fed.coordinator.port?"),
        # a misspelled key with Hydra's `+`: one line naming the key (lab.commandline), not a
        # run that ignores it (the other command-line mistakes: tests/lab/test_commandline.py)
        ("spec_decoding", ["+spec.gama=4"],
         "spec.gama is not a setting of spec_decoding; did you mean spec.gamma?"),
    ],
)  # fmt: skip
def test_a_user_error_is_one_line_and_exit_2(
    tmp_path: Path, tiny_models: Path, lab_cache: Path, module: str, overrides: list[str], says: str
) -> None:
    result = run_module(module, overrides, tmp_path=tmp_path, lab_cache=lab_cache)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in stderr_lines(result) if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert says in errors[0]
    # refused before any role process started: none printed its `[role] ` lines
    assert not re.search(r"^\[\w+\] ", result.stdout + result.stderr, re.MULTILINE)


def test_hydra_full_error_shows_the_traceback_of_a_user_error(
    tmp_path: Path, lab_cache: Path
) -> None:
    result = run_module(
        "fed_learn", ["fed.rounds=-1"], tmp_path=tmp_path, lab_cache=lab_cache,
        env={"HYDRA_FULL_ERROR": "1"},
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "fed.rounds" in result.stderr


def test_a_bug_keeps_its_traceback(tmp_path: Path, lab_cache: Path) -> None:
    # a placement hook that raises a TypeError is a bug in the hook, not a setting to fix
    hook = tmp_path / "broken_hook.py"
    hook.write_text("def place(role):\n    raise TypeError('placement hook bug')\n")
    result = run_module(
        "spec_decoding", ["target.lab_preset=debug", "draft.lab_preset=debug"],
        tmp_path=tmp_path, lab_cache=lab_cache,
        env={"LAB_PLACEMENT": "broken_hook:place",
             "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )  # fmt: skip
    assert result.returncode not in (0, 2)
    assert "Traceback" in result.stderr and "placement hook bug" in result.stderr


def test_ctrl_c_says_what_was_kept_and_how_to_go_on(
    tmp_path: Path, tiny_models: Path, lab_cache: Path
) -> None:
    import signal
    import time

    import psutil

    run_dir = tmp_path / "run"
    log = tmp_path / "stderr.log"  # read after the run; its tail says why if no checkpoint came
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fed_learn", "model.lab_preset=debug", "tracking.wandb=false",
             "fed.num_clients=2", "fed.rounds=50", "fed.local_steps=5", "fed.eval_blocks=8",
             "fed.centralized_baseline=false", f"paths.cache_dir={lab_cache}",
             f"hydra.run.dir={run_dir}"],
            stdout=subprocess.DEVNULL, stderr=err, text=True,
            # as a shell's background job starts it (`cmd &`: SIGINT ignored, which Python
            # keeps): `kill -INT` must still stop it as Ctrl-C does, however pytest was started
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )  # fmt: skip
    try:
        latest = run_dir / "coordinator" / "checkpoints" / "latest.json"
        deadline = time.monotonic() + HANG_GUARD_S  # a loaded 2-core machine is slow, not wrong
        while not latest.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert latest.is_file(), f"no checkpoint (exit {proc.poll()}): {log.read_text()[-3000:]}"
        roles = psutil.Process(proc.pid).children(recursive=True)
        assert roles  # the coordinator and the clients
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the command
        proc.wait(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert "interrupted; its checkpoints are kept in" in stderr
    (resume,) = [line.strip() for line in stderr.splitlines() if "fed.resume=true" in line]
    assert resume.startswith("python -m fed_learn") and f"hydra.run.dir={run_dir}" in resume
    _, alive = psutil.wait_procs(roles, timeout=HANG_GUARD_S)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.parametrize(
    ("module", "overrides"),
    [
        ("spec_decoding", ["target.lab_preset=debug", "draft.lab_preset=debug",
                           "spec.num_prompts=2", "spec.max_new_tokens=16"]),
        # fed_learn's and the split modules' runs with a secret: tests/lab/test_redact.py
    ],
)  # fmt: skip
def test_a_successful_run_prints_nothing_a_user_reads_as_an_error(
    tmp_path: Path, tiny_models: Path, lab_cache: Path, module: str, overrides: list[str]
) -> None:
    from labtools.readme_check import NOISE

    result = run_module(module, overrides, tmp_path=tmp_path, lab_cache=lab_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert not NOISE.search(output), [m.group(0) for m in NOISE.finditer(output)]
    assert "final metrics" in output  # the run did report, once
    assert output.count("final metrics") == 1


def test_a_refused_secret_is_one_line_that_says_the_secrets_differ(
    tmp_path: Path, tiny_models: Path, lab_cache: Path
) -> None:
    from lab.launch import free_port

    port = free_port("127.0.0.1")
    models = ["target.lab_preset=debug", "draft.lab_preset=debug", f"spec.verifier.port={port}"]
    verifier = subprocess.Popen(
        [sys.executable, "-m", "spec_decoding", "role=verifier", *models, "tracking.wandb=false",
         f"hydra.run.dir={tmp_path / 'verifier'}", f"paths.cache_dir={lab_cache}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "LAB_SECRET": "the-verifier-s"},
    )  # fmt: skip
    try:
        assert verifier.stdout is not None
        for line in verifier.stdout:  # serving once it says so
            if "verifier ready" in line:
                break
        result = run_module(
            "spec_decoding", ["role=drafter", *models], tmp_path=tmp_path / "drafter",
            lab_cache=lab_cache, env={"LAB_SECRET": "the-drafter-s"},
        )  # fmt: skip
    finally:
        verifier.kill()
        verifier.wait()
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (error,) = [line for line in stderr_lines(result) if line.startswith("error: ")]
    assert "secret" in error and "differ" in error
