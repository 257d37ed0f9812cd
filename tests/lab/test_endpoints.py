"""Each experiment's endpoints in its own section (issue 54): a cluster file names the serving
host once and every experiment's server listens there at its own port; the old `cluster.*` keys
are still read, with one warning line naming the new key, until version 0.3."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from packaging.version import Version

import lab
from lab import commandline, config, registry
from lab.config import CONF_DIR, OLD_KEYS_UNTIL, Endpoint, LabConfig, to_settings
from lab.experiment import endpoint_at
from tests.conftest import import_schemas

OLD_CLUSTER_FILE = """\
name: old
coordinator: {host: 192.0.2.7, port: 29611}
verifier: {host: 192.0.2.8, port: 29622}
master: {host: 192.0.2.9, port: 29633}
"""
"""A cluster file as conf/cluster/two_hosts.yaml was before the move (and every mine.yaml copied
from it): every experiment's server in it. Addresses of TEST-NET-1, never contacted."""


@pytest.fixture
def warned_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has warned about no old key yet (it warns once per key)."""
    monkeypatch.setattr(config, "_warned", set())


@pytest.fixture
def old_conf(tmp_path: Path) -> Path:
    """The lab's conf/ with the old cluster file beside the others (`cluster=old`)."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "cluster" / "old.yaml").write_text(OLD_CLUSTER_FILE)
    return conf


def composed(name: str, overrides: list[str], *, conf: Path, run_dir: Path) -> Any:
    import_schemas()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name=name, overrides=[f"paths.run_dir={run_dir}", *overrides])


def lab_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lab.config"]


def test_a_cluster_file_names_the_serving_host_once(compose_config) -> None:
    """conf/cluster/two_hosts.yaml names the desktop only as cluster.master: each experiment's
    server listens there, at its own port (docs/two_machines.md's table)."""
    desktop = OmegaConf.load(CONF_DIR / "cluster" / "two_hosts.yaml").master.host
    for name, key in (("fed_learn", "fed.coordinator"), ("spec_decoding", "spec.verifier")):
        assert registry.manifest(name).endpoints == (key,)
        here = to_settings(compose_config(name), LabConfig)
        there = to_settings(compose_config(name, ["cluster=two_hosts"]), LabConfig)
        port = registry.manifest(name).scenario.port  # type: ignore[union-attr]
        assert endpoint_at(here, key) == Endpoint("127.0.0.1", port)
        assert endpoint_at(there, key) == Endpoint(desktop, port)
    # the new keys on the command line win over the cluster file's host
    moved = ["cluster=two_hosts", "fed.coordinator.host=127.0.0.1", "fed.coordinator.port=5"]
    moved_settings = to_settings(compose_config("fed_learn", moved), LabConfig)
    assert endpoint_at(moved_settings, "fed.coordinator") == Endpoint("127.0.0.1", 5)


def test_an_old_key_on_the_command_line_is_read_with_one_warning(
    compose_config, caplog: pytest.LogCaptureFixture, warned_afresh: None
) -> None:
    cfg = compose_config(
        "fed_learn", ["cluster.coordinator.host=192.0.2.7", "cluster.coordinator.port=29611"]
    )
    with caplog.at_level(logging.WARNING, logger="lab.config"):
        first = to_settings(cfg, LabConfig)
        again = to_settings(cfg, LabConfig)  # a process reads its settings more than once
    assert endpoint_at(first, "fed.coordinator") == Endpoint("192.0.2.7", 29611)
    assert endpoint_at(again, "fed.coordinator") == Endpoint("192.0.2.7", 29611)
    (said,) = lab_warnings(caplog)
    assert said.startswith("cluster.coordinator is fed.coordinator now: read as ")
    assert "fed.coordinator.port=29611" in said and OLD_KEYS_UNTIL in said
    assert "\n" not in said
    # the command line's check (lab.commandline) lets it through rather than calling it a typo
    commandline.check("fed_learn", type(first), ["cluster.coordinator.port=29611"])


def test_an_old_cluster_file_composes_in_every_experiment(
    old_conf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, warned_afresh: None
) -> None:
    """Each experiment reads its own endpoint from it (one warning naming the new key) and
    drops the others' without a word; the command line's check accepts `cluster=old`."""
    for name, manifest in registry.manifests().items():
        caplog.clear()
        cfg = composed(name, ["cluster=old"], conf=old_conf, run_dir=tmp_path / name)
        with caplog.at_level(logging.WARNING, logger="lab.config"):
            settings = to_settings(cfg, LabConfig)
        assert settings.cluster.master == Endpoint("192.0.2.9", 29633)
        said = lab_warnings(caplog)
        assert [s.split(" ", 1)[0] for s in said] == list(manifest.renamed), name
        for old, new in manifest.renamed.items():
            expected = OmegaConf.select(
                OmegaConf.create(OLD_CLUSTER_FILE), old.removeprefix("cluster.")
            )
            assert endpoint_at(settings, new) == Endpoint(**expected)
        commandline.check(name, type(settings), ["cluster=old"], config_dir=old_conf)


def test_the_old_keys_are_read_until_version_0_3_only(compose_config, warned_afresh: None) -> None:
    """Below OLD_KEYS_UNTIL every old key is read; from it on, none may be: this test fails
    then until the old keys (Manifest.renamed, lab.config.OldEndpoint) are deleted."""
    renamed = {
        old: (name, new)
        for name, manifest in registry.manifests().items()
        for old, new in manifest.renamed.items()
    }
    assert renamed, "no experiment declares an old key: delete this test and OldEndpoint"
    read = {}
    for old, (name, new) in renamed.items():
        try:
            settings = to_settings(compose_config(name, [f"{old}.port=29611"]), LabConfig)
            read[old] = endpoint_at(settings, new).port == 29611
        except (ConfigCompositionException, OmegaConfBaseException):
            read[old] = False
    if Version(lab.__version__) < Version(OLD_KEYS_UNTIL):
        assert all(read.values()), read
    else:
        assert not any(read.values()), (
            f"version {lab.__version__}: the old endpoint keys were to go in {OLD_KEYS_UNTIL} "
            f"but {[old for old, was in read.items() if was]} are still read"
        )


def test_an_old_key_that_names_no_host_keeps_loopback_not_the_masters_address(
    compose_config, caplog: pytest.LogCaptureFixture, warned_afresh: None
) -> None:
    """The old keys' host defaulted to loopback; the new default is the master's (a LAN address
    in a two-host file): an old key setting only a port must not move the server onto it."""
    lan = OmegaConf.load(CONF_DIR / "cluster" / "two_hosts.yaml").master.host
    with caplog.at_level(logging.WARNING, logger="lab.config"):
        for port in (29611, 29612):  # a second config in the same process is said again
            cfg = compose_config(
                "fed_learn", ["cluster=two_hosts", f"cluster.coordinator.port={port}"]
            )
            settings = to_settings(cfg, LabConfig)
            assert endpoint_at(settings, "fed.coordinator") == Endpoint("127.0.0.1", port)
            assert lan != "127.0.0.1" and endpoint_at(settings, "fed.coordinator").host != lan
    said = lab_warnings(caplog)
    assert len(said) == 2 and all("fed.coordinator.host=127.0.0.1" in s for s in said)
