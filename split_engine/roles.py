"""The roles every split module shares (split_inference, split_training): a stage serving until
its driver releases it, the driver's side of the world, and the registry entry of a split module.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lab.cli import ConfigError
from lab.config import LabConfig
from lab.device import detect_device
from lab.experiment import Experiment, LocalPlan, Metrics, Process
from lab.launch import PeerLostError, ServiceGroup
from lab.models import resolve_source
from split_engine.config import SplitConfig
from split_engine.handshake import authenticate_stages
from split_engine.layout import stage_ranges
from split_engine.liveness import PeerWatch, heartbeat_timeout_s
from split_engine.stage import StageHost, set_stage_host
from split_engine.workers import (
    DRIVER,
    World,
    joined,
    release_all,
    serve_until_released,
    stage_name,
)
from world.fence import LOCAL_FENCE
from world.network import safe_master

log = logging.getLogger(__name__)

PING_S = 2.0
"""How often an idle stage checks that its driver is still there."""


def serve_stage(settings: LabConfig, split: SplitConfig) -> None:
    """`role=stage split.rank=K`: join the RPC world and serve until the driver is done."""
    if not 1 <= split.rank <= split.num_stages:
        raise ConfigError(
            f"role=stage needs split.rank in 1..split.num_stages={split.num_stages} "
            f"(the driver is rank 0), got {split.rank}"
        )
    if settings.cluster.master.port == 0:
        raise ConfigError("role=stage needs cluster.master.port (the driver's rendezvous port)")
    set_stage_host(StageHost(cache_dir=settings.paths.cache_path, device=detect_device()))
    with safe_master(
        settings.cluster, hub=False, name=stage_name(split.rank), num_peers=split.num_stages,
        timeout_s=split.join_timeout_s,
    ) as master:  # fmt: skip
        world = World(split.rank, master, split)
        with joined(world, secret=settings.cluster.resolved_secret()):
            print(f"{world.name} joined the run", flush=True)
            # a driver that does not answer its heartbeat in seconds is gone (not a whole
            # split.rpc_timeout_s: that bounds a call that works, not a peer's silence)
            serve_until_released(ping_s=PING_S, timeout_s=heartbeat_timeout_s(split))


@contextmanager
def driving(
    settings: LabConfig, split: SplitConfig, *, stages: ServiceGroup | None = None
) -> Iterator[PeerWatch]:
    """Join as the driver (rank 0), authenticate every stage, and release them all at the end.

    `stages`: the local stage processes, if this run started them (a dead one ends the wait).
    Yields the driver's watch over its stages (heartbeats, and their processes where local):
    its `check` raises for a stage that is gone; a long wait on the stages calls it.
    """
    if settings.cluster.master.port == 0:
        raise ConfigError("the driver needs cluster.master.port (where stages meet it)")
    secret = settings.cluster.resolved_secret()
    with (
        safe_master(
            settings.cluster,
            hub=True,
            name=DRIVER,
            num_peers=split.num_stages,
            peer_names=frozenset(stage_name(rank) for rank in range(1, split.num_stages + 1)),
            timeout_s=split.join_timeout_s,
        ) as master,
        joined(World(0, master, split), secret=secret, check=stages or (lambda: None)),
    ):
        reason, gone = "", None
        try:
            names = [stage_name(rank) for rank in range(1, split.num_stages + 1)]
            authenticate_stages(secret, names, timeout_s=split.rpc_timeout_s)
            yield PeerWatch(
                names,
                ping_timeout_s=heartbeat_timeout_s(split),
                local=stages,
            )
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            gone = exc.peer if isinstance(exc, PeerLostError) else None
            raise
        finally:
            release_all(split.num_stages, reason=reason, gone=gone)


def check_layers(settings: Any) -> None:
    """Refuse a cut the model cannot take before any stage starts: more stages than layers, or
    boundaries outside it. Reads config.json only (of a local folder; a hub model is checked by
    its stages)."""
    split: SplitConfig = settings.split
    folder = Path(resolve_source(settings.model, cache_dir=settings.paths.cache_path))
    if not (folder / "config.json").is_file():
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=settings.model.trust_remote_code)
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not isinstance(num_layers, int):
        return
    if split.num_stages > num_layers:
        raise ConfigError(
            f"split.num_stages={split.num_stages} needs at least as many layers, and "
            f"{settings.model.name} has {num_layers}: use split.num_stages<={num_layers}"
        )
    if split.boundaries:
        stage_ranges(list(split.boundaries), num_layers)


def split_experiment(
    name: str,
    run_driver: Callable[..., Metrics],
    *,
    local_threads: int | None = None,
    resume: str | None = None,
    check: Callable[[Any], None] = lambda settings: None,
    roles: dict[str, Callable[[Any], Metrics]] | None = None,
) -> Experiment:
    """The registry entry of a split module: `stage` and `driver` roles; locally, its stages
    as processes on loopback and this process the driver. `check`: the module's own checks
    before anything starts. `roles`: more roles that drive the stages as the driver does (rank
    0, hosting the rendezvous), e.g. `serve`."""
    more = dict(roles or {})

    def stage_role(settings: Any) -> Metrics:
        serve_stage(settings, settings.split)
        return {}

    def check_split(settings: Any) -> None:
        check(settings)
        if settings.model.quantization != "none" and settings.role in ("local", "driver", "serve"):
            warnings.warn(
                f"model.quantization={settings.model.quantization} is not applied by {name}: "
                "each stage, and the unsplit baseline, loads the weights in full precision "
                "(model.dtype)",
                RuntimeWarning,
                stacklevel=2,
            )

    def prepare(settings: Any) -> None:
        # Build lab: models once, here, before the stages ask; the driver loads no weights.
        check_layers(settings)

    def plan(settings: Any) -> LocalPlan:
        stages = [
            Process(f"stage{rank}", ("role=stage", f"split.rank={rank}"), service=True)
            for rank in range(1, settings.split.num_stages + 1)
        ]
        return LocalPlan(stages, main=lambda local, group: run_driver(local, stages=group))

    return Experiment(
        name=name,
        roles={"driver": run_driver, "stage": stage_role, **more},
        plan=plan,
        servers=(
            "driver",
            "stage",
            *more,
        ),  # the driver hosts the rendezvous; every rank, TensorPipe
        check=check_split,
        prepare=prepare,
        local_threads=local_threads,
        resume=resume,
        resume_roles=("local", "driver"),
        fence=LOCAL_FENCE,  # TensorPipe and Gloo take any connection: see world.fence
    )
