"""`python -m tensor_parallel`: the roles, and the local (loopback) set-up.

`role=rank` is one rank of the job (tensor_parallel.rank): a host of a real deployment, or one
process of a local run. A local run (the default) starts `tp.ranks` of them on loopback behind
the run's fence, each on its own share of this machine's cores, and when they are done copies
rank 0's figures into this run's records and table, and says what the extra ranks bought.
"""

from __future__ import annotations

import logging
from pathlib import Path
from secrets import token_hex

from omegaconf import DictConfig

from lab import experiment
from lab.cli import ConfigError
from lab.device import usable_cores
from lab.experiment import Experiment, LocalPlan, Process
from lab.records import METRICS_FILE, OUTPUTS_FILE, read_records
from lab.tracking import Tracker
from tensor_parallel.config import TensorParallelRunConfig
from tensor_parallel.rank import JOB, run_rank
from world.fence import LOCAL_FENCE

log = logging.getLogger(__name__)


def rank_name(rank: int) -> str:
    return f"rank{rank}"


def check(settings: TensorParallelRunConfig) -> None:
    """What no rank should find out first: a model without a tp plan, a rank count that does
    not divide its heads or MLP, a network master (one line each)."""
    from transformers import AutoConfig

    from lab.models import resolve_source
    from tensor_parallel.shard import check_divisible, tp_plan

    if settings.role == "local" and settings.tp.cpus:
        raise ConfigError("tp.cpus is for role=rank: a local run gives each rank its own cores")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if settings.role == "local" and gpus and settings.tp.ranks > gpus:
        raise ConfigError(
            f"tp.ranks={settings.tp.ranks} but this host has {gpus} CUDA device(s): NCCL runs "
            "one rank a GPU (CUDA_VISIBLE_DEVICES= runs them on the CPU with gloo instead)"
        )
    source = resolve_source(settings.model, cache_dir=settings.paths.cache_path)
    config = AutoConfig.from_pretrained(source)
    tp_plan(config)
    check_divisible(config, settings.tp.ranks)
    if not Path(source).is_dir():
        raise ConfigError(f"model.pretrained={source}: tensor_parallel loads from a local folder")


def cores_of(rank: int, ranks: int) -> str:
    """A local rank's own cores: an equal share of this process's (shared when fewer)."""
    import os

    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(available) < ranks:
        return ""
    share = len(available) // ranks
    return ",".join(str(c) for c in available[rank * share : (rank + 1) * share])


def local_plan(settings: TensorParallelRunConfig) -> LocalPlan:
    """`tp.ranks` rank processes on loopback; rank 0's figures become this run's."""
    ranks = settings.tp.ranks
    threads = max(1, usable_cores() // ranks)
    # the world's store takes only who knows the secret: with none set, one only these ranks
    # know (settings_role hands it over in their environment, never in argv or a file)
    drawn = () if settings.cluster.resolved_secret() else (f"cluster.secret={token_hex(32)}",)
    processes = [
        Process(
            rank_name(r),
            (
                "role=rank",
                f"tp.rank={r}",
                f"tp.cpus={cores_of(r, ranks)}",
                f"num_threads={threads}",
                "tracking.wandb=false",
                "tracking.console=false",
                *drawn,
            ),
        )
        for r in range(ranks)
    ]
    return LocalPlan(processes=processes, finish=finish_local)


def finish_local(local: TensorParallelRunConfig) -> dict[str, float]:
    """Rank 0's summary into this run's tracker (its table), then what the ranks bought."""
    records = read_records(local.paths.run_path / rank_name(0) / METRICS_FILE)
    summaries = [r for r in records if r.get("kind") == "summary"]
    if not summaries:
        raise ConfigError(f"rank 0 wrote no summary in {local.paths.run_path / rank_name(0)}")
    summary = {k: v for k, v in summaries[-1].items() if k not in ("kind", "time_s")}
    outputs = local.paths.run_path / rank_name(0) / OUTPUTS_FILE
    with Tracker.from_settings(local, job=JOB) as tracker:
        if outputs.is_file():
            tracker.outputs(read_records(outputs))
        tracker.summary(summary)
    for line in verdict(summary):
        print(line, flush=True)
    return summary


def verdict(m: dict[str, float]) -> list[str]:
    """The run's last lines: what the extra ranks bought, and why."""
    ranks = int(m.get("ranks", 2))
    lines = []
    if "same_greedy_tokens" in m:
        lines.append(
            "greedy output: identical to the unsplit model's"
            if m["same_greedy_tokens"]
            else f"greedy output: differs from the unsplit model's at token {m['diverged_at']:.0f}"
            f" (unsplit top-2 margin there {m['unsplit_top2_margin']:.2e})"
        )
    if "speedup" not in m:
        return lines
    share = m.get("collective_share")
    why = (
        f"; {share:.0%} of a rank's time went to {m['allreduces_per_token']:.0f} all-reduces a "
        f"token ({m['allreduce_bytes_per_token']:.0f} bytes each token)"
        if share is not None
        else ""
    )
    speed = m["speedup"]
    bought = f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower"
    lines.append(
        f"{ranks} ranks of {m.get('cores_per_rank', 1):.0f} core(s) each vs the unsplit model on "
        f"one rank's cores: {m['token_ms']:.2f} vs {m['unsplit_token_ms']:.2f} ms a token, "
        f"{bought}{why}; weights {m['weights_mib_per_rank']:.1f} MiB a rank vs "
        f"{m['unsplit_weights_mib']:.1f} MiB unsplit"
    )
    lines.append(
        f"what {ranks - 1} more machine(s) bought here: {bought}"
        + (
            " (the compute a rank saves outweighs its collectives)"
            if speed >= 1
            else " (a token's collectives cost more than the compute the split saves: small "
            "models and slow links lose; docs/tensor_parallel.md)"
        )
    )
    return lines


EXPERIMENT = Experiment(
    name=JOB,
    roles={"rank": run_rank},
    plan=local_plan,
    check=check,
    local_threads=0,  # each rank sets its own (num_threads above)
    fence=LOCAL_FENCE,  # gloo takes any connection: see world.fence
)


def run(cfg: DictConfig | TensorParallelRunConfig) -> dict[str, float]:
    return experiment.run(EXPERIMENT, cfg)
