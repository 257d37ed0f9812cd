"""The experiment registry: what each experiment declares for the lab's tools.

Every experiment package has one `manifest.py` whose `MANIFEST` (a `Manifest`) is its record:
the endpoints its servers listen on (in its own config section), the keys it does not read, its
serving roles, its run_matrix workload, its plots, its headline figure and the cost model's
predictor of it on a link, its multi-host scenario (with the harness's port), curve variants and
faults, its quick settings, its tour step, and a lazy reference to its runner (the
`lab.experiment.Experiment` in its `run.py`, imported only to run it). The manifest imports no
model code, so a tool loads every manifest in well under a second and never imports a run.py.

Experiments register by entry point, in pyproject.toml:

    [project.entry-points."distributed_llm_lab.experiments"]
    fed_learn = "fed_learn.manifest:MANIFEST"

and, for one outside the installed distribution (a plug-in, a test), by `register(manifest)`.
The tools iterate `manifests()` and name no experiment; `lab.experiment.get(name)` runs one.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lab.benchfigures import text
from lab.cli import ConfigError
from lab.config import register_schema
from lab.linkmodel import Link

ENTRY_POINTS = "distributed_llm_lab.experiments"
"""The entry-point group every experiment's manifest is registered under."""


@dataclass(frozen=True)
class Metric:
    """A metric drawn as a heatmap: its key in the run's summary, its label and unit."""

    key: str
    label: str
    unit: str
    ratio: bool = False
    """A ratio against the workload's baseline (drawn with a diverging palette around 1)."""


@dataclass(frozen=True)
class Workload:
    """How run_matrix sweeps the experiment: the overrides that make a cell repeat its
    measurement, and the metrics it draws."""

    metrics: tuple[Metric, ...]
    repeat: Callable[[Mapping[str, Any], int], list[str]] = lambda cell, repeats: []
    """Overrides that make one run of the cell measure `repeats` times (after its warm-up),
    given the cell's resolved settings (dotted key -> value)."""
    base: tuple[str, ...] = ()
    """Overrides every cell of this workload gets (before the sweep's own)."""
    baseline: str = ""
    """The metric that measures the workload's baseline in each cell (the target alone, the
    unsplit model): what its ratios divide by. "": none."""
    baseline_free: tuple[str, ...] = ()
    """Config keys (or prefixes ending in `.`) that do not change the baseline: cells that
    differ only in them should measure the same baseline, and one that does not was measured
    on a busy machine (labtools.matrix.busy_baselines)."""


@dataclass(frozen=True)
class Headline:
    """The one figure the cost model predicts and the curves judge the experiment by."""

    key: str
    """Its short name (`speedup`, `token_ms`)."""
    label: str
    """What it is, with its unit in parentheses: `speedup over the target alone (x)`."""
    read: Callable[[Path], float]
    """The figure of the run in a run folder (its metrics.jsonl)."""
    predict: Callable[[Path, Link], float]
    """The figure the local run in a folder predicts on a link (lab.linkmodel)."""
    means: str = ""
    """What the figure tells a user, in a sentence (the report's summary says it beside it)."""
    benchmark: str | Callable[[], str] = ""
    """The benchmark figure the docs give for the same question: the figure, its settings, the
    machine and the command that measures it (the report's summary sets a run beside it). A
    function builds it from bench/results when read (lab.benchfigures), so the figure is
    written in one place only."""
    benchmark_key: str = ""
    """The run's metric that is comparable with `benchmark` (default: `key`)."""
    verdict: Callable[[Mapping[str, Any]], list[str]] | None = None
    """What a run's figures mean, in words, from its final metrics: the headline against its
    baseline, faster or slower and why, and what to run for the realistic case. Printed as
    the run's last lines, before the W&B line (`verdict_lines`)."""

    def benchmark_text(self) -> str:
        """`benchmark` as text, its figures read now (or why they cannot be)."""
        return self.benchmark if isinstance(self.benchmark, str) else text(self.benchmark)


Compare = Callable[[Path, Path], tuple[bool, str]]
"""(the cross-host run's result folder, the loopback run's) -> (same?, what was compared)."""


@dataclass(frozen=True)
class Scenario:
    """The experiment across hosts, as docs/two_machines.md places its roles."""

    module: str
    endpoint: str
    """The dotted key of the endpoint its serving role (the first) listens on (one of its
    manifest's `endpoints`: `cluster.master`, `fed.coordinator`)."""
    roles: list[tuple[str, str, list[str]]]
    """(host, role name, overrides) in start order; the first is the serving role."""
    common: list[str]
    compare: Compare
    result_role: str
    """The role whose run folder holds what is compared."""
    netproto: bool = True
    """Its roles talk netproto (TLS applies); False: torch.distributed (the overlay applies)."""
    shared: tuple[str, ...] = ()
    """Settings naming a folder every host must see (`dp.checkpoint_dir`): the harness points
    each at one folder of its own for the run, as a user would at an NFS mount."""
    port: int = field(kw_only=True)
    """The port the host harness gives `endpoint` (docs/two_machines.md's, for this one)."""

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts its roles run on, the serving one first."""
        return tuple(dict.fromkeys(host for host, _, _ in self.roles))


class RunningRoles(Protocol):
    """What a fault sees of a scenario's running roles (labtools.hosts.Roles)."""

    def kill(self, name: str) -> None: ...

    def signal(self, name: str, signum: int, *, command: str) -> int:
        """Send `signum` to `name`'s descendant processes whose command line holds `command`
        (one worker, not the machine); returns how many there were."""

    def start(self, name: str, extra: Sequence[str] = (), *, log_suffix: str = "") -> None: ...

    def run_dir(self, name: str) -> Path: ...

    def check(self) -> None:
        """Raise if a role has failed."""


@dataclass(frozen=True)
class Fault:
    """A machine lost during the scenario's run across hosts, and how to judge what followed."""

    inject: Callable[[RunningRoles, float], None]
    """Does it to the running roles (given the deadline, time.monotonic()'s clock)."""
    settings: list[str]
    """Overrides over the scenario's for both runs."""
    reference: str
    """`same fault`: the reference run suffers the same fault on one host's loopback;
    `uninterrupted`: the reference is the plain loopback run (nothing may differ at all)."""
    compare: Compare


@dataclass(frozen=True)
class Variant:
    """One curve over delay x rate: the experiment with settings of its own."""

    name: str
    module: str
    settings: list[str]


@dataclass(frozen=True)
class Manifest:
    """What one experiment declares for the lab's tools."""

    name: str
    """Its package: `python -m <name>`, `conf/<name>.yaml`, its roles in `<name>/run.py`."""
    summary: str
    """One line: what it measures."""
    headline: Headline
    workload: Workload
    endpoints: tuple[str, ...] = ()
    """The dotted keys of the endpoints its servers listen on, in its own config section
    (`fed.coordinator`) or the shared rendezvous (`cluster.master`): a local run gives each a
    free port, the README replay puts each on loopback."""
    unread: Mapping[str, str] = field(default_factory=dict)
    """Config keys (prefixes) in its schema that it does not read, each with the reason: set on
    the command line, or swept by run_matrix, they are refused rather than silently ignored."""
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Its endpoints' old keys, each with its key now (`cluster.coordinator`: `fed.coordinator`):
    a command line or a cluster file may still set them, with a warning naming the new key,
    until version lab.config.OLD_KEYS_UNTIL."""
    serving: tuple[str, ...] = ()
    """Roles that serve until stopped (`verifier`); its other roles finish by themselves."""
    schema: str = ""
    """`module:Class` of its run config (`fed_learn.config:FedLearnRunConfig`: a dataclass
    over lab.config.LabConfig, no model code), registered as Hydra's `<name>_schema` when
    loaded (`load_schema`)."""
    runner: str = ""
    """`module:attribute` of its `lab.experiment.Experiment` (default `<name>.run:EXPERIMENT`):
    imported only when it runs."""
    quick: tuple[str, ...] = ()
    """Overrides that make a short run of it on the default models (the README replay adds
    each one a documented command does not set itself)."""
    plots: Callable[[Path], list[Path]] | None = None
    """Draws its plots from a run folder, beside the metrics (returns their paths)."""
    scenario: Scenario | None = None
    """Its roles across hosts (labtools.hosts check); None: it has no multi-host form."""
    variants: tuple[Variant, ...] = ()
    """Its curves over delay x rate (labtools.hosts curves)."""
    faults: Mapping[str, Fault] = field(default_factory=dict)
    """Machines lost mid-run (labtools.hosts faults), by name."""
    exposure: tuple[str, ...] | None = None
    """Settings over its scenario's for a run long enough that a stranger's attacks on every
    port it opens land while it trains (labtools.hosts exposure); None: not probed."""
    documented: tuple[str, ...] = ()
    """Settings its documented multi-machine commands get in the host harness (labtools.hosts
    docs), over its quick ones, for each key the command does not set."""
    tour: tuple[str, ...] | None = ()
    """The tour's overrides for it (`python -m <name> *tour`); None: not in the tour."""

    def load_runner(self) -> Any:
        """Its `lab.experiment.Experiment` (imports its run.py, model code and all)."""
        return _load(self.runner or f"{self.name}.run:EXPERIMENT")

    def schema_class(self) -> type:
        """Its run config's dataclass (imported; `load_schema` registers it for Hydra too)."""
        if not self.schema:
            raise TypeError(f"the manifest of {self.name} names no schema (module:Class)")
        return _load(self.schema)

    def load_schema(self) -> type:
        """Its run config's dataclass, registered as Hydra's `<name>_schema` (its YAML's
        `defaults` names it)."""
        schema = self.schema_class()
        # every experiment's old endpoint keys: a cluster file written for all still composes
        everyone = [*manifests().values(), self]
        renamed = {old: new for m in everyone for old, new in m.renamed.items()}
        register_schema(f"{self.name}_schema", schema, renamed=renamed)
        return schema


def _load(reference: str) -> Any:
    """The object `module:attribute` names (the module imported)."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


_lock = threading.Lock()
_registered: dict[str, Manifest] = {}
_loaded = False


def register(manifest: Manifest) -> Manifest:
    """Add `manifest` (again: replaced). Returns it, so a module can register as it defines."""
    if not isinstance(manifest, Manifest):
        raise TypeError(f"not a Manifest: {manifest!r}")
    with _lock:
        _registered[manifest.name] = manifest
    return manifest


def unregister(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def _load_entry_points() -> None:
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        found = importlib.metadata.entry_points(group=ENTRY_POINTS)
    for entry in sorted(found, key=lambda e: e.name):
        manifest = entry.load()
        if not isinstance(manifest, Manifest) or manifest.name != entry.name:
            raise TypeError(f"entry point {entry.name} = {entry.value} is not its Manifest")
        with _lock:
            _registered.setdefault(manifest.name, manifest)


def manifests() -> dict[str, Manifest]:
    """Every registered experiment, by name, in name order."""
    _load_entry_points()
    with _lock:
        found = dict(sorted(_registered.items()))
    if not found:
        raise ConfigError(
            f"no experiment is registered (entry points {ENTRY_POINTS!r}): is the project "
            "installed? `make venv` (pip install -e .) registers them"
        )
    return found


def manifest(name: str) -> Manifest:
    """The manifest of experiment `name`; ConfigError naming the registered ones if none."""
    known = manifests()
    if name not in known:
        raise ConfigError(f"no experiment {name!r}; registered: {', '.join(known)}")
    return known[name]


def verdict_lines(job: str, summary: Mapping[str, Any]) -> list[str]:
    """The lines that say what `job`'s final metrics mean ([] for a job without a verdict, or
    a summary without the figures it reads: a role's own table)."""
    manifest = find(job)
    if manifest is None or manifest.headline.verdict is None:
        return []
    try:
        return manifest.headline.verdict(summary)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return []


def find(name: str) -> Manifest | None:
    """The manifest of `name`, or None (a job that is no experiment, such as lab.pretrain)."""
    _load_entry_points()
    with _lock:
        return _registered.get(name)
