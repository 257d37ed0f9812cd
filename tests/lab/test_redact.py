"""No secret on disk or in a child's argv: every record of a run shows `***` in its place."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lab import experiment, registry
from lab.cli import ConfigError
from lab.config import REDACTED, SECRET_ENV, ClusterConfig, TrackingConfig, to_settings
from lab.launch import free_port
from lab.redact import redact_argv, redact_config, redact_text, split_secret
from lab.tracking import CONFIG_FILE, METRICS_FILE, RUN_FILE, Tracker
from labtools import report
from tests.clocks import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
SPEC_QUICK = ["target.lab_preset=debug", "draft.lab_preset=debug", "spec.num_prompts=1",
              "spec.max_new_tokens=8", "spec.prompt_tokens=16"]  # fmt: skip


def a_secret() -> str:
    """A secret no file would hold by chance."""
    return f"lab-secret-{secrets.token_hex(8)}"


@pytest.mark.parametrize(
    ("written", "recorded"),
    [
        ("cluster.secret=s3cr3t", "cluster.secret=***"),
        ("+cluster.secret=s3cr3t", "+cluster.secret=***"),
        ("cluster.secret='two words'", "cluster.secret=***"),
        ("cluster.secret_file=/home/me/.lab_secret", "cluster.secret_file=/home/me/.lab_secret"),
        ('overrides=["x=1","cluster.secret=s3cr3t"]', 'overrides=["x=1","cluster.secret=***"]'),
        ("overrides=[cluster.secret=s3cr3t,seed=1]", "overrides=[cluster.secret=***,seed=1]"),
        ("a.cluster.secret=public", "a.cluster.secret=public"),  # another key: not the secret
    ],
)  # fmt: skip
def test_a_command_line_records_the_secret_as_stars(written: str, recorded: str) -> None:
    assert redact_argv(["python", written]) == ["python", recorded]


def test_a_joined_command_a_config_and_hydras_override_dirname_show_stars() -> None:
    assert redact_text("python -m fed_learn cluster.secret=s3cr3t seed=1") == (
        "python -m fed_learn cluster.secret=*** seed=1"
    )
    assert redact_text("cluster.secret=s3cr3t,seed=1") == "cluster.secret=***,seed=1"
    config = {
        "cluster": {"secret": "s3cr3t", "secret_file": None},
        "overrides": ["cluster.secret=s3cr3t"],
    }
    assert redact_config(config) == {
        "cluster": {"secret": REDACTED, "secret_file": None},
        "overrides": ["cluster.secret=***"],
    }
    assert redact_config({"cluster": {"secret": None}}) == {"cluster": {"secret": None}}


def test_an_override_that_sets_the_secret_is_taken_out_for_the_environment() -> None:
    overrides, secret = split_secret(["role=client", "cluster.secret='s3 cr3t'"])
    assert overrides == ["role=client", "cluster.secret=***"] and secret == "s3 cr3t"
    assert split_secret(["cluster.secret=***"]) == (["cluster.secret=***"], None)


def test_the_secret_comes_from_a_file_and_a_bad_file_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    private = tmp_path / "private"
    private.write_text("from-file\n")
    private.chmod(0o600)
    assert ClusterConfig(secret_file=str(private)).resolved_secret() == b"from-file"
    shared = tmp_path / "shared"
    shared.write_text("shared-file")
    shared.chmod(0o644)
    with caplog.at_level("WARNING", logger="lab.config"):
        assert ClusterConfig(secret_file=str(shared)).resolved_secret() == b"shared-file"
    assert f"cluster.secret_file={shared} may be read by other users (mode 644)" in caplog.text
    (tmp_path / "empty").write_text("\n")
    for path, says in [(tmp_path / "missing", "cannot read it"), (tmp_path / "empty", "is empty")]:
        with pytest.raises(ConfigError) as info:
            ClusterConfig(secret_file=str(path))
        assert str(info.value).startswith(f"cluster.secret_file={path}") and says in str(info.value)
    with pytest.raises(ValueError, match=r"one of cluster\.secret and cluster\.secret_file"):
        ClusterConfig(secret="s", secret_file=str(private))


def test_stars_for_a_secret_read_the_environment_and_fail_clearly_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert ClusterConfig(secret=REDACTED).resolved_secret() == b"from-env"
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(
        ConfigError, match=r"cluster.secret=\*\*\* stands for a secret .* LAB_SECRET"
    ):
        ClusterConfig(secret=REDACTED).resolved_secret()


def test_a_tracker_keeps_a_secret_its_config_and_argv_hold_out_of_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started without Hydra's callback (a test, a bench calling `run`): its tracker still
    writes `***`, in its files and W&B's."""
    secret = a_secret()
    monkeypatch.setattr(sys, "argv", ["bench.py", f"cluster.secret={secret}", "seed=1"])
    tracking = TrackingConfig(wandb=True, wandb_mode="offline", console=False)
    config = {"cluster": {"secret": secret}, "seed": 1}
    with Tracker(tmp_path, config=config, tracking=tracking, job="unit") as tracker:
        tracker.summary({"loss": 1.0})
    assert "secret: '***'" in (tmp_path / CONFIG_FILE).read_text()
    # the command as a shell takes it back (shlex-quoted: `*` is the shell's)
    assert "'cluster.secret=***' seed=1" in json.loads((tmp_path / RUN_FILE).read_text())["command"]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files)
    assert not [str(p) for p in files if secret.encode() in p.read_bytes()]


def test_the_report_shows_stars_for_a_secret_an_older_record_holds(tmp_path: Path) -> None:
    secret = a_secret()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_FILE).write_text(
        json.dumps({"job": "fed_learn", "command": f"python -m fed_learn cluster.secret={secret}"})
    )
    (run_dir / METRICS_FILE).write_text(json.dumps({"kind": "summary", "loss": 1.0}) + "\n")
    (run_dir / "fed_rounds.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    page = report.write_report([run_dir], tmp_path / "report")
    for written in (page, page.parent / "index.md"):
        text = written.read_text()
        assert secret not in text and "python -m fed_learn cluster.secret=***" in text


@pytest.mark.parametrize("name", list(registry.manifests()))
def test_no_role_gets_the_secret_in_its_argv_or_its_config_file(
    compose_config: Callable[..., object], tiny_models: Path, tmp_path: Path, name: str
) -> None:
    """Every process a local run starts (`ps` shows any user its argv), as run_local builds it."""
    secret = a_secret()
    exp = experiment.get(name)
    settings = to_settings(compose_config(name, [f"cluster.secret={secret}"]), exp.schema)
    _, plan, roles = experiment._local_roles(exp, settings, None)
    assert roles and len(roles) == len(plan.processes)
    for role in roles:
        assert not any(secret in word for word in role.argv), role.argv
        assert role.env[SECRET_ENV] == secret  # it travels in the environment instead
        config_text = (tmp_path / f"{role.name}_config.yaml").read_text()
        assert secret not in config_text and f"secret: '{REDACTED}'" in config_text


def _start(
    argv: list[str], *, cwd: Path, log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, *argv], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )  # fmt: skip


def _finish(proc: subprocess.Popen, log: Path, *, timeout_s: float = HANG_GUARD_S) -> str:
    """What the process printed, once it has ended well."""
    try:
        proc.wait(timeout=timeout_s)
    finally:
        proc.kill()
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:]
    return output


def test_no_run_of_any_module_writes_the_secret(
    tmp_path: Path, tiny_models: Path, lab_cache: Path
) -> None:
    """Every module, run as a user runs it from a folder of theirs with the secret on its command
    line (or in a file), W&B on (offline), then run_matrix and a report over all of it: no byte
    under outputs/, multirun/, reports/ or the W&B folders is the secret, and the runs did
    authenticate with it."""
    secret = a_secret()
    work = tmp_path / "work"  # the user's folder: outputs/, multirun/, reports/
    work.mkdir()
    secret_file = tmp_path / "lab_secret"  # outside `work`, as the logs: the secret may be there
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    given = f"cluster.secret={secret}"
    started = time.time()
    commands = {
        "fed_learn": ["-m", "fed_learn", given, "model.lab_preset=debug", "fed.num_clients=1",
                      "fed.min_fit_clients=1", "fed.rounds=1", "fed.local_steps=2",
                      "fed.eval_blocks=2", "fed.max_examples_per_client=16",
                      "fed.centralized_baseline=false"],
        "split_inference": ["-m", "split_inference", given, "model.lab_preset=debug",
                            "generate.num_prompts=1", "generate.max_new_tokens=4",
                            "generate.baseline=false"],
        "split_training": ["-m", "split_training", f"cluster.secret_file={secret_file}",
                           "model.lab_preset=debug", "split.steps=2", "split.max_train_blocks=16"],
        "run_matrix": [str(ROOT / "run_matrix.py"), "workload=spec_decoding",
                       "overrides=[" + ",".join(f'"{o}"' for o in [*SPEC_QUICK, given]) + "]",
                       "~grid.context", "~grid.batch", "+grid.window=[2]", "repeats=1",
                       "wandb=true"],
    }  # fmt: skip
    logs = {name: tmp_path / f"{name}.log" for name in [*commands, "verifier", "drafter"]}
    # a verifier holding the secret in LAB_SECRET: the drafter gets it on its command line, so
    # its finishing proves that what it was given is what authenticated
    at_verifier = f"spec.verifier.port={free_port()}"
    verifier = _start(
        ["-m", "spec_decoding", "role=verifier", *SPEC_QUICK, at_verifier, "tracking.wandb=false",
         "hydra.run.dir=outputs/verifier"],
        cwd=work, log=logs["verifier"], env={SECRET_ENV: secret},
    )  # fmt: skip
    runs = {name: _start(argv, cwd=work, log=logs[name]) for name, argv in commands.items()}
    try:
        deadline = time.monotonic() + HANG_GUARD_S  # five runs start beside it
        while "verifier ready" not in logs["verifier"].read_text():
            assert verifier.poll() is None and time.monotonic() < deadline, "no verifier"
            time.sleep(0.2)
        runs["drafter"] = _start(
            ["-m", "spec_decoding", "--multirun", "role=drafter", given, *SPEC_QUICK,
             at_verifier], cwd=work, log=logs["drafter"],
        )  # fmt: skip
        outputs = {name: _finish(proc, logs[name]) for name, proc in runs.items()}
    finally:
        verifier.send_signal(signal.SIGINT)  # it serves until stopped, as its user would
        with contextlib.suppress(subprocess.TimeoutExpired):
            verifier.wait(timeout=30)
        for proc in [verifier, *runs.values()]:
            proc.kill()
    for name in ("fed_learn", "split_inference", "split_training"):
        assert "(auth)" in outputs[name], f"{name}'s server did not require the secret"
    from labtools.readme_check import NOISE

    for name, output in outputs.items():  # and a successful run prints nothing that alarms
        assert not NOISE.search(output), (name, [m.group(0) for m in NOISE.finditer(output)])
        if name != "run_matrix":
            assert output.count("final metrics") == 1, name
    (cell_log,) = work.glob("outputs/matrix/spec_decoding/cells/*/cell.log")
    assert "(auth)" in cell_log.read_text()
    records = [*work.glob("outputs/*/*/lab_run.json"), *work.glob("multirun/*/*/0/lab_run.json")]
    run_dirs = [record.parent for record in records]  # fed_learn, split_*, the drafter
    assert len(run_dirs) == 4, run_dirs
    report_run = subprocess.run(
        [sys.executable, "-m", "labtools.report", *map(str, run_dirs),
         "outputs/matrix/spec_decoding"],
        cwd=work, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert report_run.returncode == 0, report_run.stderr[-3000:]

    # the records are all there, each with `***` for the secret
    (page,) = work.glob("reports/*/index.html")
    assert page.read_text().count("cluster.secret=***") == 4  # 3 commands and the sweep's
    (overrides,) = work.glob("multirun/spec_decoding/*/0/.hydra/overrides.yaml")
    assert "cluster.secret=***" in overrides.read_text()
    wandb_runs = list(work.glob("**/wandb/offline-run-*"))
    assert len(wandb_runs) == 5, wandb_runs  # 4 runs of modules and run_matrix's own
    wandb_logs = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "wandb"
    files = [p for p in work.rglob("*") if p.is_file()]
    files += [p for p in wandb_logs.rglob("*") if p.is_file() and p.stat().st_mtime >= started]
    leaks = [str(p) for p in files if secret.encode() in p.read_bytes()]
    assert not leaks
