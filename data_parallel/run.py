"""`python -m data_parallel`: the roles, and the local (loopback) set-up.

`role=worker` is one host of a data-parallel job: torch's elastic agent in this process, its
workers (dp.workers) started and restarted by it (data_parallel.launch). A local run (the
default) starts that agent as its own process, a job of one host on loopback at a free port,
and when it is done copies its records into this run's metrics, W&B run and final table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from data_parallel.config import DataParallelRunConfig
from data_parallel.launch import run_agent
from data_parallel.sync_methods import Auto, sync_method
from data_parallel.worker import JOB, checkpoint_dir
from lab import experiment
from lab.cli import ConfigError
from lab.experiment import Experiment, LocalPlan, Process
from lab.records import METRICS_FILE, read_records
from lab.tracking import Tracker
from world.fence import LOCAL_FENCE

log = logging.getLogger(__name__)

AGENT = "agent"
"""The local run's agent process, and its run folder under this run's."""


def check(settings: DataParallelRunConfig) -> None:
    """What no worker should find out first: settings that cannot run here, a resume with
    nothing to resume."""
    dp = settings.dp
    if settings.cluster.overlay.up and dp.node_bounds[0] != dp.node_bounds[1]:
        raise ConfigError(
            f"dp.nnodes={dp.nnodes} with cluster.overlay.up=true: the lab's overlay is built once "
            "for a fixed set of hosts; set dp.nnodes=N, or bring up your own overlay and name it "
            "in cluster.overlay.interface"
        )
    if settings.role == "local" and dp.node_bounds != (1, 1):
        raise ConfigError(
            f"dp.nnodes={dp.nnodes} is for role=worker (one command per host); a local run is "
            "one host: set dp.workers instead"
        )
    if dp.node_bounds[1] > 1 and not dp.checkpoint_dir:
        raise ConfigError(
            f"dp.nnodes={dp.nnodes} needs dp.checkpoint_dir: one folder every host sees (NFS, a "
            "mounted bucket), where each worker writes its part of a checkpoint (DCP)"
        )
    if settings.model.quantization != "none":
        raise ConfigError(
            f"model.quantization={settings.model.quantization}: data_parallel trains "
            "full-precision weights (every replica holds and updates them all)"
        )
    if torch.cuda.is_available() and dp.workers > torch.cuda.device_count():
        raise ConfigError(
            f"dp.workers={dp.workers} but this host has {torch.cuda.device_count()} CUDA "
            "device(s): NCCL cannot run two workers on one GPU"
        )
    if dp.resume:
        check_resume(settings)
    if dp.init_from:
        from data_parallel.checkpoint import LATEST, META, latest

        warm = Path(dp.init_from).expanduser()
        if not (warm / META).is_file() and latest(warm) is None:
            raise ConfigError(
                f"dp.init_from={dp.init_from}: no checkpoint there (neither {LATEST} nor a "
                f"checkpoint's {META}); point it at a run's checkpoints folder"
            )


def check_resume(settings: DataParallelRunConfig) -> None:
    """`dp.resume=true` needs a checkpoint short of dp.steps: refused before anything starts."""
    from data_parallel.checkpoint import LATEST, latest_step

    folder = checkpoint_dir(settings if settings.role != "local" else _agent_settings(settings))
    step = latest_step(folder)
    if step is None:
        raise ConfigError(
            f"dp.resume=true, but there is no checkpoint at {folder / LATEST}: point "
            "hydra.run.dir (or dp.checkpoint_dir) at the run to resume"
        )
    written = checkpoint_sync(folder)
    chosen = sync_method(settings.dp.sync)
    if sync_method(written).apart != chosen.apart and chosen is not Auto:
        raise ConfigError(
            f"the checkpoint in {folder} was written with dp.sync={written}, whose optimizer "
            f"state dp.sync={settings.dp.sync} does not keep (DiLoCo's outer and per-worker "
            f"inner state, or one shared optimizer): resume it with dp.sync={written}"
        )
    if step >= settings.dp.steps:
        raise ConfigError(
            f"nothing left to train: the checkpoint in {folder} is at step {step} and "
            f"dp.steps={settings.dp.steps}; to train further, resume with dp.steps={step + 20} "
            "(or any number above the checkpoint's step)"
        )


def checkpoint_sync(folder: Path) -> str:
    """The dp.sync of the run that wrote the newest checkpoint in `folder`."""
    import json

    from data_parallel.checkpoint import META, latest

    newest = latest(folder)
    if newest is None:
        return "ddp"
    meta = json.loads((newest / META).read_text())
    return str(meta.get("config", {}).get("dp", {}).get("sync", "ddp"))


def _agent_settings(settings: DataParallelRunConfig) -> DataParallelRunConfig:
    """The settings the local run's agent gets: its run folder is `<run dir>/agent`."""
    from dataclasses import replace

    agent_dir = str(settings.paths.run_path.resolve() / AGENT)
    return replace(settings, paths=replace(settings.paths, run_dir=agent_dir))


def prepare(settings: DataParallelRunConfig) -> None:
    """Build the lab's tiny models (or find a hub model) once, before the agent starts."""
    from lab.models import resolve_source

    resolve_source(settings.model, cache_dir=settings.paths.cache_path)


def local_plan(settings: DataParallelRunConfig) -> LocalPlan:
    """One host's agent on loopback (its records reach W&B and the console from here, once)."""
    agent = Process(
        AGENT, ("role=worker", "dp.nnodes=1", "tracking.wandb=false", "tracking.console=false")
    )
    metrics = settings.paths.run_path / AGENT / METRICS_FILE
    skip = len(read_records(metrics)) if metrics.is_file() else 0  # a resumed run's earlier ones
    return LocalPlan(processes=[agent], finish=lambda local: finish_local(local, skip_records=skip))


def finish_local(local: DataParallelRunConfig, *, skip_records: int = 0) -> dict[str, Any]:
    """A local run's metrics: the agent's records (this execution's, each step once: a step
    trained again after a restart replaces the lost one) into this run's tracker."""
    records = read_records(local.paths.run_path / AGENT / METRICS_FILE)[skip_records:]
    kept: dict[tuple, dict] = {}
    summary: dict[str, Any] = {}
    for record in records:
        values = {k: v for k, v in record.items() if k not in ("kind", "time_s", "step")}
        if record.get("kind") == "summary":
            summary = values
            continue
        key = (record.get("step"), tuple(sorted(values)))
        kept.pop(key, None)  # the last record of a step and kind wins, in its place
        kept[key] = values | ({"step": record["step"]} if "step" in record else {})
    if summary and local.dp.baseline and local.dp.workers > 1:
        summary |= one_process_baseline(local, summary)
    with Tracker.from_settings(local, job=JOB) as tracker:
        for values in kept.values():
            step = values.pop("step", None)
            tracker.log(values, step=step)
        tracker.summary(summary)
    return summary


BASELINE = "baseline"
"""The one-process baseline's run folder, under this run's."""


def baseline_settings(local: DataParallelRunConfig) -> DataParallelRunConfig:
    """One process on the run's global batch (dp.workers times dp.batch_size), the same steps
    and data, synchronised by nothing: what N DDP workers equal exactly."""
    from dataclasses import replace

    dp = replace(local.dp, workers=1, batch_size=local.dp.batch_size * local.dp.workers,
                 sync="ddp", balance="none", slow_worker="", fragments=1, overlap_steps=0,
                 checkpoint_every=0, checkpoint_dir=None, resume=False, nnodes="1",
                 baseline=False)  # fmt: skip
    return replace(
        local, role="worker", dp=dp,
        paths=replace(local.paths, run_dir=str(local.paths.run_path.resolve() / BASELINE)),
        tracking=replace(local.tracking, wandb=False, console=False),
    )  # fmt: skip


def one_process_baseline(local: DataParallelRunConfig, ours: dict[str, Any]) -> dict[str, float]:
    """The run's baseline, trained here after it (behind the same fence, on its ports): one
    process, the same tokens; its figures and ours over them."""
    settings = baseline_settings(local)
    print(f"data_parallel: the one-process baseline: 1 worker, batch {settings.dp.batch_size}, "
          f"the same {local.dp.steps} steps (dp.baseline=false skips it)", flush=True)  # fmt: skip
    theirs = run_agent(settings)
    figures = {"one_process_tokens_per_s": float(theirs["tokens_per_s"]),
               "one_process_final_loss": float(theirs["final_loss"])}  # fmt: skip
    figures["tokens_per_s_over_one_process"] = float(ours["tokens_per_s"]) / float(
        theirs["tokens_per_s"]
    )
    if "val_loss" in theirs and "val_loss" in ours:
        figures["one_process_val_loss"] = float(theirs["val_loss"])
        figures["val_loss_over_one_process"] = float(ours["val_loss"]) / float(theirs["val_loss"])
    return figures


EXPERIMENT = Experiment(
    name=JOB,
    roles={"worker": run_agent},
    plan=local_plan,
    check=check,
    prepare=prepare,
    local_threads=0,  # the agent computes nothing; each worker takes its share of the cores
    resume="dp.resume=true",
    resume_roles=("local", "worker"),
    fence=LOCAL_FENCE,  # Gloo takes any connection: see world.fence
)


def run(cfg: DictConfig | DataParallelRunConfig) -> dict[str, float]:
    return experiment.run(EXPERIMENT, cfg)
