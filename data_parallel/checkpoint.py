"""Checkpoints with torch.distributed.checkpoint (DCP): every worker writes its part, atomically,
and any number of workers reads them back (DCP reshards).

    <checkpoint_dir>/
      latest.json          {"step": 10, "folder": "step-000010"}: replaced last, atomically
      step-000010/         DCP's files (.metadata, __<rank>_0.distcp) and meta.json: the step,
                           the data position, the tokens and seconds so far, the job that
                           wrote it, and the resolved config that produced it

A checkpoint is written into a fresh hidden folder beside its final name, renamed into place once
every worker has written, and only then does `latest.json` point at it: a crash at any moment
leaves the previous checkpoint the latest, whole. The newest KEEP are kept.

DCP writes a replicated tensor (DDP's weights) from one worker and each shard from its owner, so a
resharded resume needs every part: across hosts, checkpoint_dir must be one folder every host
sees. `check_shared` refuses to start when it is not (a marker written by rank 0 must be visible to
every rank), rather than find out at the first resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lab import atomic
from lab.cli import ConfigError

log = logging.getLogger(__name__)

LATEST = "latest.json"
RANK_STATE = "rank-{rank}.pt"
"""A worker's own state beside DCP's files (top-k's residuals, PowerSGD's error feedback and
factors), read back with weights_only=True: tensors, never pickled objects."""
META = "meta.json"
KEEP = 2
"""Checkpoints kept (the newest); older ones are removed once a newer one is in place."""
OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Trainable weights only (with dp.lora=true, the adapters: the base model is the one loaded)."""
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading them leaves the frozen weights as loaded; dcp.load has already refused a checkpoint
that lacks a trainable one."""


@dataclass(frozen=True)
class Position:
    """Where a run stands: what a checkpoint restores besides the weights and optimizer."""

    step: int = 0
    blocks: int = 0
    """Training blocks consumed: the data stream's position (data_parallel.data)."""
    tokens: int = 0
    wall_s: float = 0.0
    """Seconds spent training (not loading), over every run that led here."""


def collective_device() -> torch.device:
    """Where this process group's collectives take their tensors (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    outer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """What a checkpoint holds. With DiLoCo's `outer` optimizer, each worker's inner optimizer
    differs from the others': it is kept under the worker's rank (`optim-rank<r>`), the outer
    one (the same on every worker) under `outer`."""
    weights, optim = get_state_dict(model, optimizer, options=OPTIONS)
    if outer is None:
        return {"model": weights, "optim": optim}
    outer_state = get_optimizer_state_dict(model, outer, options=OPTIONS)
    return {"model": weights, inner_key(): optim, "outer": outer_state}


def inner_key(rank: int | None = None) -> str:
    """Where a DiLoCo worker's own inner optimizer state is kept in a checkpoint."""
    return f"optim-rank{dist.get_rank() if rank is None else rank}"


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    position: Position,
    *,
    config: dict[str, Any],
    job: str = "",
    outer: torch.optim.Optimizer | None = None,
    rank_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Every worker's part of the model and optimizer at `position`, then `latest.json` (a
    collective: every rank calls it)."""
    final = directory / f"step-{position.step:06d}"
    state = _state(model, optimizer, outer)
    with contextlib.ExitStack() as stack:
        staging = None
        if dist.get_rank() == 0:
            staging = stack.enter_context(atomic.staged_dir(final))
        folder = Path(_broadcast(None if staging is None else str(staging)))
        if rank_state is not None:  # this worker's own (a hook's state): tensors only
            torch.save(rank_state, folder / RANK_STATE.format(rank=dist.get_rank()))
        dcp.save(state, checkpoint_id=folder)
        dist.barrier()
        if staging is not None:
            meta = {**position.__dict__, "world_size": dist.get_world_size(), "job": job,
                    "config": config}  # fmt: skip
            (staging / META).write_text(json.dumps(meta, indent=1))
        # leaving the block renames rank 0's staging folder to `final`
    if dist.get_rank() == 0:
        latest = {"step": position.step, "folder": final.name}
        atomic.write_text(directory / LATEST, json.dumps(latest))
        for old in sorted(directory.glob("step-*"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def latest(directory: Path) -> Path | None:
    """The folder of the newest whole checkpoint in `directory`, or None."""
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    folder = directory / json.loads(pointer.read_text())["folder"]
    return folder if (folder / META).is_file() else None


def latest_step(directory: Path) -> int | None:
    """The step of the newest checkpoint in `directory` (None: none)."""
    folder = latest(directory)
    return None if folder is None else int(json.loads((folder / META).read_text())["step"])


def job_of(folder: Path) -> str:
    """The job that wrote the checkpoint in `folder` (data_parallel.launch's token; "" for none)."""
    return str(json.loads((folder / META).read_text()).get("job", ""))


def load(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    outer: torch.optim.Optimizer | None = None,
) -> Position:
    """Restore the model and optimizer (and DiLoCo's outer one) from `folder`, resharded to
    this world; returns the position it was saved at (a collective).

    A DiLoCo worker whose rank did not exist when the checkpoint was written (it was written
    by fewer workers) starts its inner optimizer afresh, and says so."""
    state = _state(model, optimizer, outer)
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    tops = {key.split(".", 1)[0] for key in saved}
    if ("outer" in tops) != (outer is not None):
        written = "dp.sync=diloco" if "outer" in tops else "a dp.sync other than diloco"
        raise ConfigError(
            f"the checkpoint in {folder} was written with {written}: resume it with the dp.sync "
            "it was trained with (DiLoCo keeps other optimizer state than DDP)"
        )
    own = inner_key() if outer is not None else "optim"
    if own not in tops:
        log.warning("rank %d: the checkpoint in %s has no inner optimizer state of this "
                    "rank (written by fewer workers): starting it afresh", dist.get_rank(),
                    folder)  # fmt: skip
        del state[own]
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)
    if own in state:
        set_optimizer_state_dict(model, optimizer, state[own], options=LOAD_OPTIONS)
    if outer is not None:
        set_optimizer_state_dict(model, outer, state["outer"], options=LOAD_OPTIONS)
    return _position(json.loads((folder / META).read_text()))


def load_weights(folder: Path, model: torch.nn.Module) -> Position:
    """Only the model weights of the checkpoint in `folder` (a warm start: dp.init_from), or of
    the newest in it; returns the position it was written at (a collective)."""
    newest = folder if (folder / META).is_file() else latest(folder)
    if newest is None:
        raise ConfigError(f"dp.init_from={folder}: no checkpoint there (no {LATEST} or {META})")
    weights, _ = get_state_dict(model, [], options=OPTIONS)
    state = {"model": weights}
    dcp.load(state, checkpoint_id=newest)
    set_model_state_dict(model, state["model"], options=LOAD_OPTIONS)
    return _position(json.loads((newest / META).read_text()))


def _position(meta: dict[str, Any]) -> Position:
    return Position(step=int(meta["step"]), blocks=int(meta["blocks"]), tokens=int(meta["tokens"]),
                    wall_s=float(meta["wall_s"]))  # fmt: skip


def load_rank_state(folder: Path, *, rank: int | None = None) -> dict[str, torch.Tensor] | None:
    """This worker's own state (or worker `rank`'s) in the checkpoint at `folder` (None: it has
    none, e.g. the checkpoint was written by fewer workers)."""
    path = folder / RANK_STATE.format(rank=dist.get_rank() if rank is None else rank)
    if not path.is_file():
        return None
    state = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ConfigError(f"{path} is not a checkpoint's worker state (names to tensors)")
    return state


def check_shared(directory: Path) -> None:
    """ConfigError on every rank unless `directory` is one folder for all of them (a collective):
    rank 0 writes a marker, every rank looks for it."""
    token = secrets.token_hex(8)
    marker = directory / f".shared-{token}"
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(token)
    token = _broadcast(token)
    marker = directory / f".shared-{token}"
    seen = torch.tensor(
        [0 if marker.is_file() else 1], dtype=torch.int64, device=collective_device()
    )
    dist.all_reduce(seen)
    dist.barrier()
    if dist.get_rank() == 0:
        marker.unlink(missing_ok=True)
    if int(seen.item()):
        raise ConfigError(
            f"dp.checkpoint_dir={directory} is not one folder for every host ({int(seen.item())} "
            "workers do not see what rank 0 wrote there): DCP writes each worker's part of a "
            "checkpoint where that worker runs, so resuming needs them all in one place; point "
            "dp.checkpoint_dir at a shared file system (NFS, a mounted bucket) on every host"
        )
