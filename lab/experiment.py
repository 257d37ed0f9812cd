"""The experiment dispatcher: what each module runs as, and the one function that runs it.

Each experiment module declares, in its `run.py`, one `Experiment`: the function behind each
of its roles and its local plan (which roles a `role=local` run starts as their own processes,
and what this process does meanwhile). What the tools read too (its config schema, the
endpoints its roles listen on, the config keys it does not read) is in its manifest
(lab.registry), the one record of the experiment; the Experiment reads it from there.
`run(experiment, cfg)` does the rest, the same way for every module: validates the config,
refuses keys the experiment would ignore, picks the role, gives local roles free ports and their
share of the cores, starts them as process groups, waits for servers to be ready before
anything dials them, and stops everything on the way out.

`python -m <module>`, the tests, the benches and `run_matrix.py` all go through it. A placement
hook (`place`, or `LAB_PLACEMENT=module:function` in the environment) sees every role before it
starts and may rewrite its command, e.g. to run it inside a network namespace.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

from omegaconf import DictConfig

from lab import registry
from lab.cli import ConfigError, reported
from lab.config import ClusterConfig, Endpoint, LabConfig, is_loopback, to_settings
from lab.device import apply_num_threads, share_of_cores
from lab.launch import PeerLostError, Role, ServiceGroup, free_port, launch, services, settings_role
from lab.multirun import JOB_LABEL_ENV, job_label, sweep_keys

log = logging.getLogger(__name__)

PLACEMENT_ENV = "LAB_PLACEMENT"
"""`package.module:function` taking and returning a `lab.launch.Role`: where local roles run."""

READY_TIMEOUT_S = 300.0
"""Longest wait for a local server role to load its model and listen."""

Metrics = dict[str, float]
Placement = Callable[[Role], Role]


class FencedAddress(Protocol):
    @property
    def address(self) -> str:
        """Where every role of the run listens."""
        ...


class Fencing(Protocol):
    """What puts a local run's listeners behind a fence: an address of its own that only this
    user's processes reach. `world.fence.LOCAL_FENCE` is the one there is (the world floor
    hands it to an experiment, which hands it here: lab does not import upward)."""

    def loopback(self) -> AbstractContextManager[FencedAddress]:
        """The fence, up for the block, and the address the run's roles listen on."""
        ...

    def namespace_reason(self) -> str | None:
        """Why a local run should re-run inside a private network namespace (no nftables
        here, or asked for); None when it need not."""
        ...

    def namespace_argv(self, argv: list[str]) -> list[str] | None:
        """The command that re-runs `argv` in that namespace; None where none can be made."""
        ...

    def run_inside(self, argv: list[str]) -> int:
        """Run that command to its end, handing it Ctrl-C; its exit status."""
        ...


@dataclass(frozen=True)
class Process:
    """A role that a local run starts as its own OS process."""

    name: str
    overrides: tuple[str, ...]
    """Hydra overrides that make it that role (`role=client`, `client_index=1`, ...)."""
    service: bool = False
    """A server: stopped once the run's other roles are done."""
    ready: str | None = None
    """A line fragment it prints once it serves: nothing else starts before it appears."""


@dataclass(frozen=True)
class LocalPlan:
    """What `role=local` starts, and what this process does while they run."""

    processes: list[Process]
    main: Callable[[Any, ServiceGroup], Metrics] | None = None
    """This process's own role, run once every ready-announcing process is ready (its second
    argument checks the processes: RoleFailedError when one has died). None: this process only
    waits for the processes to finish, then calls `finish`."""
    finish: Callable[[Any], Metrics] | None = None
    """Without `main`: the run's metrics, collected after every process finished."""


@dataclass(frozen=True)
class Experiment:
    """One experiment module, as the registry runs it."""

    name: str
    """The module (`python -m name`); its YAML is `conf/<name>.yaml`, its schema `<name>_schema`."""
    roles: Mapping[str, Callable[[Any], Metrics]]
    """Every role but `local`, by name, with the function that plays it."""
    plan: Callable[[Any], LocalPlan]
    check: Callable[[Any], None] = lambda settings: None
    """Validation across sections, run before anything starts (ValueError naming the keys)."""
    prepare: Callable[[Any], None] = lambda settings: None
    """Local runs: build or fetch what every role needs once (the models), before they start."""
    local_threads: int | None = None
    """torch threads per local process when `num_threads=0`: None gives each process its share
    of the cores; 0 leaves torch's default; N pins N."""
    servers: tuple[str, ...] = ()
    """The roles that listen for peers (at `endpoints`, or TensorPipe's ports): started on a
    network address without a secret, they warn that anyone who reaches them can join."""
    resume: str | None = None
    """The override that continues an interrupted run from what it saved (`fed.resume=true`):
    Ctrl-C then prints the command that goes on."""
    resume_roles: tuple[str, ...] = ("local",)
    """The roles whose run `resume` continues (the one that keeps the checkpoints)."""
    checkpoint_marker: str = "latest.json"
    """The file a checkpoint is complete with, somewhere in the run folder: Ctrl-C claims
    checkpoints only where one is."""
    fence: Fencing | None = None
    """Some of its listeners are not authenticated by the run (TensorPipe's, Gloo's): a local
    run puts them behind this fence (`world.fence.LOCAL_FENCE`): an address of its own that
    only this user's processes reach."""

    @property
    def schema(self) -> type[LabConfig]:
        """Its run config's dataclass, as its manifest names it (`Manifest.schema`)."""
        return registry.manifest(self.name).schema_class()

    @property
    def schema_name(self) -> str:
        return f"{self.name}_schema"

    @property
    def role_names(self) -> tuple[str, ...]:
        return ("local", *self.roles)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Its manifest's endpoints (dotted keys)."""
        return registry.manifest(self.name).endpoints

    def unread_keys(self) -> dict[str, str]:
        return unread_keys(registry.manifest(self.name))

    def refuse_unread(self, keys: Sequence[str]) -> None:
        refuse_unread(registry.manifest(self.name), keys)


def unread_keys(manifest: registry.Manifest) -> dict[str, str]:
    """`manifest.unread`, plus every `cluster.*` endpoint but its own and every other
    experiment's old endpoint key (`cluster.verifier`): its roles never dial them."""
    own = ", ".join(manifest.endpoints)
    others = {
        f"cluster.{f.name}": f"its roles meet at {own} only"
        for f in fields(ClusterConfig)
        if f.type in (Endpoint, "Endpoint") and f"cluster.{f.name}" not in manifest.endpoints
    }
    for name, other in registry.manifests().items():
        for old, new in other.renamed.items():
            if old not in manifest.renamed:
                others[old] = f"it was {name}'s endpoint ({new} now); its roles meet at {own} only"
    return {**others, **manifest.unread}


def refuse_unread(manifest: registry.Manifest, keys: Sequence[str]) -> None:
    """ConfigError for the first key (dotted, as on the command line) `manifest`'s experiment
    does not read."""
    unread = unread_keys(manifest)
    for key in keys:
        for prefix, why in unread.items():
            if key == prefix or key.startswith(prefix + "."):
                raise ConfigError(f"{manifest.name} does not read {key}: {why}")


def endpoint_at(settings: Any, key: str) -> Endpoint:
    """The endpoint at dotted `key` of `settings` (`cluster.master`, `fed.coordinator`)."""
    value = settings
    for part in key.split("."):
        value = getattr(value, part)
    assert isinstance(value, Endpoint), f"{key} is not an endpoint"
    return value


def with_endpoints(settings: Any, moved: Mapping[str, Endpoint]) -> Any:
    """`settings` with the endpoint at each dotted key of `moved` replaced (frozen or not, the
    sections along the way are copied, never changed in place)."""
    for key, endpoint in moved.items():
        head, _, rest = key.partition(".")
        inner = endpoint if not rest else with_endpoints(getattr(settings, head), {rest: endpoint})
        settings = replace(settings, **{head: inner})
    return settings


def get(name: str) -> Experiment:
    """The registered experiment `name` (lab.registry; imports its `run.py`)."""
    manifest = registry.manifest(name)  # ConfigError naming the registered ones
    manifest.load_schema()  # Hydra composes its YAML over it
    experiment = manifest.load_runner()
    assert isinstance(experiment, Experiment) and experiment.name == name
    return experiment


def override_key(override: str) -> str:
    """The dotted key a Hydra override sets: `+a.b=1` -> `a.b`, `model@target=x` -> `target`."""
    key = override.split("=", 1)[0].lstrip("+~")
    if "@" in key:  # a config group placed at another package: the package is the key
        key = key.split("@", 1)[1]
    return key


def command_line_keys() -> list[str]:
    """The keys set on this process's command line (empty when Hydra is not running)."""
    return [override_key(o) for o in _task_overrides()]


def placement_from_env() -> Placement | None:
    """The placement hook named by $LAB_PLACEMENT, if any."""
    spec = os.environ.get(PLACEMENT_ENV)
    if not spec:
        return None
    module, _, attribute = spec.partition(":")
    hook = getattr(importlib.import_module(module), attribute, None)
    if not callable(hook):
        raise ConfigError(f"{PLACEMENT_ENV}={spec!r} does not name a function (module:function)")
    return hook


def run(
    experiment: Experiment, cfg: DictConfig | Any, *, place: Placement | None = None
) -> Metrics:
    """Run `cfg.role` of `experiment` (every role, for `local`); returns its headline metrics."""
    settings = validated(experiment, cfg)
    if settings.role != "local":
        if settings.role in experiment.servers:
            warn_if_open(settings.role, settings, experiment.endpoints)
        apply_num_threads(settings.num_threads)
        return experiment.roles[settings.role](settings)
    return run_local(experiment, settings, place=place or placement_from_env())


def validated(experiment: Experiment, cfg: DictConfig | Any) -> Any:
    """`cfg` as `experiment`'s settings, every check across keys done (ConfigError, one line,
    naming the keys): what a run refuses before it starts or waits for anything."""
    settings = to_settings(cfg, experiment.schema)
    if settings.role not in experiment.role_names:
        raise ConfigError(
            f"{experiment.name} has roles {', '.join(experiment.role_names)}; not {settings.role}"
        )
    experiment.refuse_unread(command_line_keys())
    experiment.check(settings)
    settings.cluster.resolved_secret()  # `cluster.secret=***` without LAB_SECRET fails here
    return settings


def warn_if_open(role: str, settings: Any, endpoints: Sequence[str]) -> None:
    """Say so when `role` will listen beyond loopback (at `endpoints` of `settings`) with no
    secret set."""
    hosts = {key: endpoint_at(settings, key).host for key in endpoints}
    exposed = settings.cluster.open_to_the_network(hosts)
    if exposed:
        log.warning(
            "role=%s listens on the network (%s) without a secret: anyone who reaches its ports "
            "can join the run. Set the same LAB_SECRET (or cluster.secret_file) on every host",
            role,
            ", ".join(exposed),
        )


@contextlib.contextmanager
def fenced(experiment: Experiment, settings: Any) -> Iterator[tuple[Any, FencedAddress | None]]:
    """A local run's settings with its endpoints on the fence's address, for the block (the
    fence up): unchanged for an experiment whose listeners all authenticate."""
    hosts = [endpoint_at(settings, key).host for key in experiment.endpoints]
    if experiment.fence is None or not all(is_loopback(host) for host in hosts):
        yield settings, None
        return
    with experiment.fence.loopback() as fence:
        moved = {
            key: Endpoint(fence.address, endpoint_at(settings, key).port)
            for key in experiment.endpoints
        }
        yield with_endpoints(settings, moved), fence


def _local_roles(
    experiment: Experiment, settings: Any, place: Placement | None
) -> tuple[Any, LocalPlan, list[Role]]:
    """A `role=local` run's settings (free ports, thread share), its plan and its processes."""
    experiment.prepare(settings)
    ports = {}
    for key in experiment.endpoints:
        host = endpoint_at(settings, key).host
        ports[key] = Endpoint(host, free_port(host))
    local = with_endpoints(settings, ports)
    plan = experiment.plan(local)  # its processes get `local` (threads included) when they start
    if local.num_threads == 0 and experiment.local_threads != 0:
        threads = experiment.local_threads or share_of_cores(
            len(plan.processes) + (plan.main is not None)
        )
        local = replace(local, num_threads=threads)
    apply_num_threads(local.num_threads)
    roles = [
        settings_role(
            process.name,
            experiment.name,
            local,
            schema=experiment.schema_name,
            overrides=process.overrides,
            service=process.service,
            ready=process.ready,
        )
        for process in plan.processes
    ]
    if place is not None:
        roles = [place(role) for role in roles]
    return local, plan, roles


def run_local(experiment: Experiment, settings: Any, *, place: Placement | None = None) -> Metrics:
    """Every role of `experiment` as its own process on this machine (behind the fence, for an
    experiment that has one)."""
    with fenced(experiment, settings) as (settings, _):
        local, plan, roles = _local_roles(experiment, settings, place)
        if plan.main is None:
            if plan.finish is None:
                raise TypeError(f"{experiment.name}'s local plan has neither main nor finish")
            launch(roles)
            return plan.finish(local)
        with services(roles) as group:
            group.wait_ready(settings.cluster.connect_timeout_s + READY_TIMEOUT_S)
            return plan.main(local, group)


@contextlib.contextmanager
def serving(
    experiment: Experiment,
    cfg: DictConfig | Any,
    *,
    place: Placement | None = None,
    out: TextIO | None = None,
) -> Iterator[tuple[Any, ServiceGroup]]:
    """The servers of `experiment`'s local plan alone, started exactly as `role=local` starts
    them and ready when the block begins; yields the settings that name their ports, and the
    group (call it to check that they still run). For benches and tests that drive the servers
    with clients of their own. Their output goes to `out` (stdout by default), prefixed with the
    role; every server is stopped on leaving the block."""
    settings = to_settings(cfg, experiment.schema)
    experiment.check(settings)
    with fenced(experiment, settings) as (settings, _):
        local, _, roles = _local_roles(experiment, settings, place or placement_from_env())
        servers = [role for role in roles if role.service]
        if not servers:
            raise TypeError(f"{experiment.name}'s local plan starts no servers")
        with services(servers, out=out) as group:
            group.wait_ready(settings.cluster.connect_timeout_s + READY_TIMEOUT_S)
            yield local, group


def main(experiment: Experiment, cfg: DictConfig) -> Metrics:
    """`python -m <experiment>`: run it as `run` does, ending as a command should: a problem the
    user can fix is one line on stderr (exit 2), Ctrl-C says what was kept and how to go on
    (exit 130), a bug keeps its traceback. Returns the run's metrics (a multirun's summary
    table collects them: lab.multirun). In a multirun, the job's settings go to its roles in
    JOB_LABEL_ENV, so every table it prints names them."""
    label = _multirun_label()
    if label:
        os.environ[JOB_LABEL_ENV] = label
    restart = _namespace_restart(experiment, cfg, job=bool(label))
    if restart is not None:
        assert experiment.fence is not None
        why = experiment.fence.namespace_reason()
        print(
            f"{experiment.name}: re-running {'this job ' if label else ''}in a private network "
            f"namespace (unshare -rn), where no other process of this host reaches its ports "
            f"({why})",
            flush=True,
        )
    try:
        with reported(interrupted=interrupted_message(experiment, cfg)):
            if restart is not None:
                assert experiment.fence is not None
                code = experiment.fence.run_inside(restart)
                if not label:
                    raise SystemExit(code)
                if code == 128 + signal.SIGINT:  # Ctrl-C, handed to the job inside
                    raise KeyboardInterrupt
                return _job_summary(code)  # a multirun job's metrics, for the sweep's table
            try:
                return run(experiment, cfg)
            except PeerLostError as exc:  # a process of the run died: say how to go on
                command = resume_command(experiment, cfg)
                if command:
                    # across hosts this process is one role, the others started by hand
                    local = str(cfg.get("role", "local")) == "local"
                    first = "" if local else "start its other roles again, then "
                    exc.resume = f"{first}go on from its last checkpoint with: {command}"
                raise
    finally:
        os.environ.pop(JOB_LABEL_ENV, None)


def _namespace_restart(
    experiment: Experiment, cfg: DictConfig, *, job: bool = False
) -> list[str] | None:
    """The command that re-runs this one inside a private network namespace: a local run of a
    fenced experiment by a user who cannot put up the nftables fence (`world.fence`); None
    when it needs none or none can be made (the run then says it is unfenced). `job`: one job
    of a multirun, re-run alone with its own overrides in its own folder."""
    fence = experiment.fence
    if fence is None or str(cfg.get("role", "local")) != "local":
        return None
    if fence.namespace_reason() is None:
        return None
    argv = sys.orig_argv
    if "-m" not in argv or argv[argv.index("-m") + 1 :][:1] != [experiment.name]:
        return None  # not `python -m <module>` (a test, a tool calling main): nothing to re-run
    from hydra.core.hydra_config import HydraConfig

    if job:
        overrides = [o for o in _task_overrides() if override_key(o) != "hydra.run.dir"]
        argv = [sys.executable, "-m", experiment.name, *overrides]
    else:
        argv = [sys.executable, *sys.orig_argv[1:]]
    if HydraConfig.initialized() and not any(a.startswith("hydra.run.dir=") for a in argv):
        # the same run folder inside as out here
        argv.append(f"hydra.run.dir={HydraConfig.get().runtime.output_dir}")
    return fence.namespace_argv(argv)


def _job_summary(code: int) -> Metrics:
    """A multirun job that ran inside its namespace: its summary metrics, read from the
    metrics file it wrote in its folder; ConfigError naming the folder if it failed."""
    from hydra.core.hydra_config import HydraConfig

    from lab.records import METRICS_FILE, read_records

    folder = Path(HydraConfig.get().runtime.output_dir)
    if code != 0:
        raise ConfigError(f"this job failed in its namespace (exit {code}): its log is in {folder}")
    records = read_records(folder / METRICS_FILE) if (folder / METRICS_FILE).exists() else []
    summaries = [r for r in records if r.get("kind") == "summary"]
    if not summaries:
        return {}
    return {k: float(v) for k, v in summaries[-1].items() if isinstance(v, int | float)}


def _multirun_label() -> str:
    """This job's settings when it is one job of a multirun, else ""."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    # the basic launcher runs the jobs in this process: its command line names what was swept
    return job_label(list(HydraConfig.get().overrides.task), sweep_keys(sys.argv[1:]))


def interrupted_message(experiment: Experiment, cfg: DictConfig) -> Callable[[], str]:
    """What Ctrl-C leaves behind, and the command that continues from it where one can (a
    function: whether a checkpoint exists is known when Ctrl-C comes, not before)."""
    return lambda: _interrupted(experiment, cfg)


def _run_dir(cfg: DictConfig) -> str:
    try:
        return str(cfg.paths.run_dir)
    except Exception:
        return ""


def _interrupted(experiment: Experiment, cfg: DictConfig) -> str:
    role = str(cfg.get("role", "local"))
    run_dir = _run_dir(cfg)
    where = f"; its log and metrics so far are in {run_dir}" if run_dir else ""
    if experiment.resume is None or role not in experiment.resume_roles or not run_dir:
        return f"interrupted{where}"
    command = resume_command(experiment, cfg)
    if not command:
        return f"interrupted before its first checkpoint: nothing to go on from{where}"
    return (
        f"interrupted; its checkpoints are kept in {run_dir}. "
        f"Go on from the last one with:\n  {command}"
    )


def resume_command(experiment: Experiment, cfg: DictConfig) -> str:
    """The command that continues this run from its last checkpoint: this run's own command
    line with the experiment's `resume` override; "" where this role cannot resume or the run
    has saved no checkpoint yet."""
    role = str(cfg.get("role", "local"))
    run_dir = _run_dir(cfg)
    if experiment.resume is None or role not in experiment.resume_roles or not run_dir:
        return ""
    if not any(Path(run_dir).rglob(experiment.checkpoint_marker)):
        return ""
    resume_key = override_key(experiment.resume)
    kept = [
        o
        for o in _task_overrides()
        if override_key(o) not in (resume_key, "hydra.run.dir", "paths.run_dir")
    ]
    return shlex.join(
        ["python", "-m", experiment.name, *kept, experiment.resume, f"hydra.run.dir={run_dir}"]
    )


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return list(HydraConfig.get().overrides.task)
