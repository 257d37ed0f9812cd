"""The experiment registry: every module's roles, refused keys and local plan, dispatched once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lab import experiment, registry
from lab.launch import Role, ServiceGroup, services
from tests.clocks import HANG_GUARD_S


@pytest.mark.parametrize("name", list(registry.manifests()))
def test_every_module_registers_an_experiment_with_a_local_plan(compose_config, name: str) -> None:
    """Each module's local plan starts its processes under names its roles know."""
    exp = experiment.get(name)
    assert exp.name == name and "local" in exp.role_names
    settings = experiment.to_settings(compose_config(name), exp.schema)
    plan = exp.plan(settings)
    assert plan.processes and (plan.main is not None or plan.finish is not None)
    for process in plan.processes:
        role = next(o.split("=", 1)[1] for o in process.overrides if o.startswith("role="))
        assert role in exp.roles


@pytest.mark.parametrize("name", list(registry.manifests()))
def test_a_role_the_experiment_does_not_have_is_refused_before_anything_runs(
    compose_config, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"{name} has roles local, .*; not boss"):
        experiment.run(experiment.get(name), compose_config(name, ["role=boss"]))


@pytest.mark.parametrize(
    ("name", "key", "why"),
    [
        ("spec_decoding", "model.pretrained", "target.pretrained"),
        ("split_inference", "cluster.link.delay_ms", "TensorPipe's traffic"),
        ("split_training", "cluster.tls.enabled", "TensorPipe does not use"),
        ("fed_learn", "cluster.verifier.port", r"spec_decoding's endpoint \(spec.verifier now"),
        ("spec_decoding", "cluster.master.port", "its roles meet at spec.verifier only"),
    ],
)
def test_a_key_the_experiment_does_not_read_is_refused_naming_why(
    name: str, key: str, why: str
) -> None:
    exp = experiment.get(name)
    with pytest.raises(ValueError, match=rf"{name} does not read {key}: .*{why}"):
        exp.refuse_unread([key])
    exp.refuse_unread(["seed", "cluster.secret"])  # read by every experiment


def test_override_keys_are_read_as_hydra_writes_them() -> None:
    assert experiment.override_key("+cluster.link.delay_ms=3") == "cluster.link.delay_ms"
    assert experiment.override_key("model@target=tinyllama") == "target"
    assert experiment.override_key("~model.revision") == "model.revision"


@pytest.mark.parametrize(
    ("module", "override", "message"),
    [
        # a link delay shapes netproto's traffic, not TensorPipe's: a split run with one would
        # measure an undelayed link under a delayed label
        ("split_inference", "cluster.link.delay_ms=10",
         "split_inference does not read cluster.link.delay_ms"),
        # was accepted, recorded and ignored (spec reads target.* and draft.*)
        ("spec_decoding", "model.pretrained=/nonexistent",
         "spec_decoding reads target.* and draft.*, not model.*"),
    ],
)  # fmt: skip
def test_the_cli_refuses_a_key_the_module_would_ignore(
    tmp_path, module: str, override: str, message: str
) -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", module, override,
         f"hydra.run.dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}"],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "cache").exists()  # refused before building any model


def test_a_server_that_has_not_announced_itself_is_waited_for() -> None:
    """A client dialled the verifier before it listened (`cluster.link.delay_ms=10` failed):
    local roles now wait for a server's ready line."""
    slow = Role(
        "server",
        [sys.executable, "-c", "import time; time.sleep(1.0); print('ready now', flush=True); "
         "time.sleep(60)"],
        service=True, ready="ready now",
    )  # fmt: skip
    with services([slow], out=sys.stderr) as group:
        assert not group.running[0].ready.is_set()
        group.wait_ready(HANG_GUARD_S)
        assert group.running[0].ready.is_set()


def test_a_server_that_dies_before_it_is_ready_is_reported() -> None:
    from lab.launch import RoleFailedError

    dying = Role(
        "server", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
        service=True, ready="ready",
    )  # fmt: skip
    with services([dying], out=sys.stderr) as group, pytest.raises(RoleFailedError, match="3"):
        group.wait_ready(HANG_GUARD_S)
    assert isinstance(group, ServiceGroup)


def test_a_placement_hook_sees_every_role_before_it_starts(compose_config, monkeypatch) -> None:
    """run_matrix and the hosts harness put roles elsewhere (a namespace) through this hook."""
    seen: list[str] = []

    def place(role: Role) -> Role:
        seen.append(role.name)
        return Role(role.name, [sys.executable, "-c", "pass"], service=role.service)

    exp = experiment.get("fed_learn")
    cfg = compose_config("fed_learn", ["fed.num_clients=2"])
    finished = experiment.Experiment(
        name=exp.name, roles=exp.roles,
        plan=lambda s: experiment.LocalPlan(exp.plan(s).processes, finish=lambda s: {"ok": 1.0}),
    )  # fmt: skip
    assert experiment.run(finished, cfg, place=place) == {"ok": 1.0}
    assert seen == ["coordinator", "client0", "client1"]


@pytest.mark.parametrize(
    ("module", "role", "endpoint"),
    [("fed_learn", "coordinator", "fed.coordinator"),
     ("spec_decoding", "verifier", "spec.verifier"),
     ("split_inference", "stage", "cluster.master"),
     ("split_training", "driver", "cluster.master")],
)  # fmt: skip
def test_a_server_role_on_a_network_address_without_a_secret_warns(
    compose_config, caplog, monkeypatch, module: str, role: str, endpoint: str
) -> None:
    from lab.config import to_settings

    monkeypatch.delenv("LAB_SECRET", raising=False)
    exp = experiment.get(module)
    assert role in exp.servers
    assert exp.endpoints == (endpoint,)
    lan = f"{endpoint}.host=192.168.1.20"
    settings = to_settings(compose_config(module, [lan]), exp.schema)
    with caplog.at_level("WARNING", logger="lab.experiment"):
        experiment.warn_if_open(role, settings, exp.endpoints)
    assert f"role={role} listens on the network ({lan}) without a secret" in caplog.text
    caplog.clear()
    for quiet in ([lan, "cluster.secret=s3cret"], [f"{endpoint}.host=127.0.0.1"]):
        settings = to_settings(compose_config(module, quiet), exp.schema)
        experiment.warn_if_open(role, settings, exp.endpoints)
    assert caplog.text == ""


def test_tensorpipe_listens_on_the_interface_that_leads_to_the_master() -> None:
    import psutil

    from world.network import interface_towards

    loopback = interface_towards("127.0.0.1")
    addresses = [a.address for a in psutil.net_if_addrs()[loopback]]
    assert "127.0.0.1" in addresses
    assert interface_towards("localhost") == loopback
    assert interface_towards("no-such-host.invalid") is None  # unresolvable: torch decides


def test_tensorpipe_and_gloo_both_listen_towards_the_master_unless_the_user_chose(
    monkeypatch,
) -> None:
    """init_rpc builds a Gloo group beside TensorPipe: left to itself it advertised the address
    of the host's name (loopback on Debian), and stages on other hosts were refused."""
    from lab.config import Endpoint
    from world.network import (
        INTERFACE_VARIABLES,
        interface_towards,
        listening_towards,
    )

    for name in INTERFACE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    loopback = interface_towards("127.0.0.1")
    with listening_towards(Endpoint("127.0.0.1", 29530)):
        assert os.environ["TP_SOCKET_IFNAME"] == os.environ["GLOO_SOCKET_IFNAME"] == loopback
    assert not any(name in os.environ for name in INTERFACE_VARIABLES)  # a later world decides anew
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "wg0")  # the user's own choice is kept
    with listening_towards(Endpoint("127.0.0.1", 29530)):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "wg0"
        assert os.environ["TP_SOCKET_IFNAME"] == loopback
    assert os.environ["GLOO_SOCKET_IFNAME"] == "wg0" and "TP_SOCKET_IFNAME" not in os.environ


def test_ctrl_c_claims_checkpoints_only_once_one_exists(tmp_path: Path) -> None:
    """Ctrl-C before the first checkpoint said checkpoints were kept; it is said when it comes,
    from what the run folder holds then."""
    from omegaconf import OmegaConf

    from fed_learn.run import EXPERIMENT

    cfg = OmegaConf.create({"role": "local", "paths": {"run_dir": str(tmp_path)}})
    message = experiment.interrupted_message(EXPERIMENT, cfg)
    assert message().startswith("interrupted before its first checkpoint: nothing to go on from")
    latest = tmp_path / "coordinator" / "checkpoints" / "latest.json"
    latest.parent.mkdir(parents=True)
    latest.write_text("{}")
    assert message().startswith(f"interrupted; its checkpoints are kept in {tmp_path}")
    assert "fed.resume=true" in message()


@pytest.mark.parametrize("role", ["local", "driver"])
def test_a_lost_process_is_said_with_the_command_that_goes_on_once_a_checkpoint_exists(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    role: str,
) -> None:
    """A run that a dead process ended (PeerLostError) says, on its one error line, the command
    that resumes it; across hosts (a role of its own) that the other roles start again first;
    before its first checkpoint, nothing about going on."""
    from omegaconf import OmegaConf

    from lab.launch import RoleFailedError
    from split_training.run import EXPERIMENT

    def lost(*args: object, **kwargs: object) -> dict[str, float]:
        raise RoleFailedError("stage2", -9, [])

    monkeypatch.setattr(experiment, "run", lost)
    cfg = OmegaConf.create({"role": role, "paths": {"run_dir": str(tmp_path)}})
    with pytest.raises(SystemExit):
        experiment.main(EXPERIMENT, cfg)
    assert capsys.readouterr().err.strip() == (
        "error: role 'stage2' was killed by SIGKILL (by a user, or the kernel out of memory)"
    )
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.json").write_text("{}")
    with pytest.raises(SystemExit):
        experiment.main(EXPERIMENT, cfg)
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: role 'stage2' was killed by SIGKILL")
    first = "" if role == "local" else "start its other roles again, then "
    assert f"; {first}go on from its last checkpoint with: python -m split_training " in error
    assert error.endswith(f"split.resume=true hydra.run.dir={tmp_path}")


def test_a_multirun_summary_has_a_column_per_swept_key_and_a_row_per_job() -> None:
    from lab.multirun import job_label, summary_rows, sweep_keys, swept_keys

    jobs = [
        ({"fed.strategy": "fedavg", "seed": "0"}, {"final_val_loss": 3.21, "rounds": 3.0}),
        ({"fed.strategy": "ffa", "seed": "0"}, {"final_val_loss": 3.1234567, "rounds": 3.0}),
        ({"fed.strategy": "median", "seed": "0"}, None),  # failed
    ]
    assert swept_keys([values for values, _ in jobs]) == ["fed.strategy"]
    keys, metrics, rows = summary_rows(jobs)
    assert keys == ["fed.strategy"] and metrics == ["final_val_loss", "rounds"]
    assert rows == [["fedavg", "3.2100", "3"], ["ffa", "3.1235", "3"], ["median", "failed", ""]]
    raw = summary_rows(jobs, readable=False)[2]  # summary.csv's: as Python writes them
    assert raw[1] == ["ffa", "3.1234567", "3.0"]
    assert summary_rows(jobs, first=["rounds"])[1] == ["rounds", "final_val_loss"]
    # fed_learn's answer against its centralized baseline is kept, however many metrics come
    # first (it was cut off the table as the ninth)
    many = {f"m{i}": float(i) for i in range(12)} | {"federated_over_centralized": 0.97}
    shown = summary_rows([({"seed": "0"}, many), ({"seed": "1"}, many)], first=["m0"])[1]
    assert shown[:2] == ["m0", "federated_over_centralized"] and len(shown) == 8
    job = ["fed.strategy=ffa", "hydra.run.dir=x", "seed=1"]
    assert job_label(job) == "fed.strategy=ffa seed=1"
    assert job_label(job, sweep_keys(["fed.strategy=fedavg,ffa", "seed=1", "a=range(2)"])) == (
        "fed.strategy=ffa"
    )
