"""docs/architecture.md's checklist for adding an experiment, held true: an experiment defined
only in a temporary folder, registered by this test, appears in run_matrix's workloads (and a
sweep of it runs), the tour's steps, the harness's scenarios, the cost model and the report,
without a change to any other file of the repository."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from lab import registry

ROOT = Path(__file__).resolve().parent.parent

MANIFEST = '''
"""What the tools need from {name}: a toy that "measures" x squared."""

from pathlib import Path

from lab.linkmodel import Link, run_summary
from lab.plots import pyplot, save
from lab.records import same_losses
from lab.registry import Headline, Manifest, Metric, Scenario, Variant, Workload, register


def value(run_dir: Path) -> float:
    return float(run_summary(run_dir)["value"])


def predict(run_dir: Path, link: Link) -> float:
    return value(run_dir) + 1e3 * link.rtt_s  # one round trip per run, in ms


def plots(run_dir: Path) -> list[Path]:
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, value(run_dir)])
    return [save(fig, plt, run_dir / "toy.png")]


MANIFEST = Manifest(
    name="{name}",
    schema="{name}.run:ToyRunConfig",
    endpoints=("toy.server",),  # its own endpoint, in its own section
    unread={{"model": "the toy loads no model"}},
    serving=("server",),
    summary="a toy experiment that lives in a temporary folder",
    headline=Headline("value", "the value (ms)", value, predict),
    workload=Workload(
        (Metric("value", "x squared", "ms"),),
        repeat=lambda cell, repeats: [f"toy.repeats={{repeats}}"],
    ),
    quick=("toy.x=2",),
    plots=plots,
    scenario=Scenario(
        "{name}", "toy.server",
        [("desktop", "server", ["role=server"]), ("laptop", "client", ["role=client"])],
        ["toy.x=2"], same_losses("value"), result_role="client", port=29540,
    ),
    variants=(Variant("{name}_plain", "{name}", ["toy.x=3"]),),
)
register(MANIFEST)  # a plug-in outside the installed distribution registers itself
'''

RUN = '''
"""The toy's roles: one process that logs x squared, `toy.repeats` times."""

from dataclasses import dataclass, field

from lab.config import Endpoint, LabConfig
from lab.experiment import Experiment, LocalPlan
from lab.tracking import Tracker


@dataclass
class ToyConfig:
    x: float = 1.0
    repeats: int = 1
    server: Endpoint = field(default_factory=Endpoint)


@dataclass
class ToyRunConfig(LabConfig):
    toy: ToyConfig = field(default_factory=ToyConfig)


def measure(settings, group=None):
    tracker = Tracker.from_settings(settings, job="{name}")
    for step in range(settings.toy.repeats):
        tracker.log({{"value": settings.toy.x ** 2}}, step=step)
    metrics = {{"value": settings.toy.x ** 2, "server_port": settings.toy.server.port}}
    tracker.summary(metrics)
    tracker.close()
    return metrics


EXPERIMENT = Experiment(
    name="{name}",
    roles={{"server": measure, "client": measure}},
    plan=lambda settings: LocalPlan(processes=[], main=measure),
)
'''

MAIN = """
from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
"""

CONF = """
defaults:
  - {name}_schema
  - config
  - _self_

hydra:
  searchpath: [file://{root}/conf]
  job:
    name: {name}
"""


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[registry.Manifest]:
    """The toy experiment's package in a temporary folder, importable and registered."""
    name = f"toy_{secrets.token_hex(4)}"
    package = tmp_path / "plugins" / name
    (package / "conf").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "manifest.py").write_text(MANIFEST.format(name=name))
    (package / "run.py").write_text(RUN.format(name=name))
    (package / "__main__.py").write_text(MAIN.format(name=name))
    (package / "conf" / f"{name}.yaml").write_text(CONF.format(name=name, root=ROOT))
    monkeypatch.syspath_prepend(str(package.parent))
    path = os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # its processes (a sweep's cells) import it too
    module = __import__(f"{name}.manifest", fromlist=["MANIFEST"])
    assert isinstance(module, ModuleType)
    manifest = registry.register(module.MANIFEST)
    try:
        yield manifest
    finally:
        registry.unregister(name)
        for key in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
            del sys.modules[key]


def test_the_toy_joins_every_tool_and_no_file_of_the_repository_changes(
    toy: registry.Manifest, tmp_path: Path
) -> None:
    from lab import experiment
    from labtools import costmodel, hosts, matrix, report, tour

    before = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    name = toy.name

    # the tour and the harness list it beside the others
    assert (name, ["-m", name]) in tour.steps()
    assert hosts.scenarios()[name] is toy.scenario
    assert name in hosts.modules()
    assert f"{name}_plain" in costmodel.variants()

    # run_matrix sweeps it: a grid of two cells, each its own process tree
    out = tmp_path / "sweep"
    config = matrix.MatrixConfig(
        workload=name, axes={"x": "toy.x"}, grid={"x": [2, 3]}, repeats=2, out_dir=str(out),
        timeout_s=240.0, plot=False,
    )  # fmt: skip
    assert matrix.workload_of(config) is toy.workload
    from labtools import sweep

    sweep.sweep(config)
    rows = [json.loads(line) for line in (out / matrix.RESULTS_JSONL).read_text().splitlines()]
    assert {r["status"] for r in rows} == {"ok"}, rows
    assert sorted(r["metrics"]["value"] for r in rows) == [4.0, 9.0]
    # its own endpoint: each local run gave it a free port, and the shared ones are not its
    assert all(r["metrics"]["server_port"] > 0 for r in rows)
    unread = experiment.unread_keys(toy)
    assert "toy.server" not in unread and {"cluster.master", "model"} <= set(unread)

    # the cost model predicts its headline from a run of it
    run_dir = Path(rows[0]["run_dir"])
    local = costmodel.headline(name, run_dir)
    assert costmodel.predict(name, run_dir, delay_ms=5, rate=None) == pytest.approx(local + 10)

    # the report shows it, with the plot its manifest draws
    page = report.write_report([run_dir], tmp_path / "report")
    text = (tmp_path / "report" / "index.md").read_text()
    assert name in text and "toy.png" in text, text[:2000]
    assert page.is_file()

    after = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert after == before, "adding an experiment changed files of the repository"


def test_a_manifest_that_is_not_one_is_refused() -> None:
    with pytest.raises(TypeError, match="not a Manifest"):
        registry.register("fed_learn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no experiment 'nope'; registered: .*fed_learn"):
        registry.manifest("nope")
