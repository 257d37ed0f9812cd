"""`python -m split_training`: roles, the training loop, and the local (loopback) set-up."""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import DictConfig
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from lab import experiment
from lab.cli import ConfigError
from lab.corpus import train_and_validation_blocks
from lab.device import detect_device, supports_bf16
from lab.launch import ServiceGroup
from lab.models import load_tokenizer
from lab.tracking import Tracker
from split_engine.roles import driving, split_experiment
from split_engine.sharded import ShardedModel
from split_training.config import SplitTrainConfig, SplitTrainingRunConfig
from split_training.trainer import LATEST, DistributedTrainer, bubble_fraction

log = logging.getLogger(__name__)


def training_blocks(tokenizer, split: SplitTrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, block_size) token ids from the stdlib corpus' training split, and
    (split.eval_blocks, block_size) from its validation split."""
    return train_and_validation_blocks(
        tokenizer,
        block_size=split.block_size,
        max_train_blocks=split.max_train_blocks,
        eval_blocks=split.eval_blocks,
    )


def batch_schedule(num_blocks: int, split: SplitTrainConfig, *, seed: int) -> list[list[list[int]]]:
    """Block indices per step, per accumulated batch: a pure function of the seed, so a resumed
    run sees exactly the batches the uninterrupted run would have."""
    rng = random.Random(seed)
    order: list[int] = []
    per_step = split.batch_size * split.grad_accum_steps
    while len(order) < split.steps * per_step:
        epoch = list(range(num_blocks))
        rng.shuffle(epoch)
        order.extend(epoch)
    steps = []
    for step in range(split.steps):
        chunk = order[step * per_step : (step + 1) * per_step]
        steps.append(
            [chunk[i : i + split.batch_size] for i in range(0, per_step, split.batch_size)]
        )
    return steps


def mixed_precision(split: SplitTrainConfig) -> str:
    """`auto` becomes bf16 where the stages' device type has it (CUDA), none elsewhere."""
    if split.mixed_precision != "auto":
        return split.mixed_precision
    device = detect_device()
    return "bf16" if device.type == "cuda" and supports_bf16(device) else "none"


def checkpoint_dir(settings: SplitTrainingRunConfig) -> Path:
    """Where the driver keeps its checkpoints (`split.checkpoint_dir`, or the run's own)."""
    split = settings.split
    return Path(split.checkpoint_dir or settings.paths.run_path / "checkpoints").resolve()


def check_resume(settings: SplitTrainingRunConfig) -> None:
    """`split.resume=true` needs a checkpoint short of `split.steps`: refused before any stage
    starts, since a finished run has nothing left to train."""
    split = settings.split
    if not split.resume or settings.role not in ("local", "driver"):
        return
    latest = checkpoint_dir(settings) / LATEST
    if not latest.is_file():
        raise ConfigError(
            f"split.resume=true, but there is no checkpoint at {latest}: point hydra.run.dir "
            "(or split.checkpoint_dir) at the run to resume"
        )
    step = int(json.loads(latest.read_text())["step"])
    if step >= split.steps:
        raise ConfigError(
            f"nothing left to train: the checkpoint in {latest.parent} is at step {step} and "
            f"split.steps={split.steps}; to train further, resume with split.steps={step + 20} "
            "(or any number above the checkpoint's step)"
        )


def run_driver(
    settings: SplitTrainingRunConfig, *, stages: ServiceGroup | None = None
) -> dict[str, float]:
    """`role=driver`: build the split model for training and train it."""
    split = settings.split
    tokenizer = load_tokenizer(settings.model, cache_dir=settings.paths.cache_path)
    blocks, val_blocks = training_blocks(tokenizer, split)
    schedule = batch_schedule(len(blocks), split, seed=settings.seed)
    checkpoints = checkpoint_dir(settings)
    lora = asdict(settings.lora) if split.lora else None
    if lora is not None:
        lora = {
            "r": lora["r"],
            "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"],
            "target_modules": list(lora["target_modules"]),
        }
    with (
        Tracker.from_settings(settings, job="split_training") as tracker,
        driving(settings, split, stages=stages) as peers,
    ):
        sharded = ShardedModel.build(
            settings.model,
            split,
            training=True,
            mixed_precision=mixed_precision(split),
            lora=lora,
            seed=settings.seed,
        )
        trainer = DistributedTrainer(sharded, split, watch=peers)
        if split.export and "config.json" not in sharded.call(0, "model_files"):
            raise ConfigError(  # found out now, not after the whole run
                f"split.export=true, but {settings.model.pretrained!r} has no config.json "
                "the first stage can read"
            )
        if split.resume:
            manifest = trainer.load(checkpoints)
            log.info("resumed from step %d (%s)", trainer.step, checkpoints / manifest["folder"])
        losses: list[float] = []
        val_loss = float("nan")
        tokens, seconds = 0, 0.0
        saved_peak = [0] * split.num_stages
        cpu_before = [s["cpu_s"] for s in sharded.stats()]
        wall_before = time.perf_counter()
        progress = Progress(
            TextColumn("split_training"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total} loss {task.fields[loss]}"),
            TimeRemainingColumn(),
        )
        with progress:
            task = progress.add_task("train", total=split.steps, completed=trainer.step, loss="-")
            for step in range(trainer.step, split.steps):
                batches = [blocks[indices] for indices in schedule[step]]
                result = trainer.train_step(batches)
                losses.append(result.loss)
                tokens += result.tokens
                seconds += result.seconds
                saved_peak = [
                    max(a, b) for a, b in zip(saved_peak, result.saved_peak_bytes, strict=True)
                ]
                tracker.log(
                    {
                        "loss": result.loss,
                        "grad_norm": result.grad_norm,
                        "step_s": result.seconds,
                        "saved_mb": max(result.saved_peak_bytes) / 2**20,
                    },
                    step=trainer.step,
                )
                progress.update(task, completed=trainer.step, loss=f"{result.loss:.3f}")
                every = split.eval_every
                if every and (trainer.step % every == 0 or trainer.step == split.steps):
                    val_loss = trainer.evaluate(val_blocks, batch_size=split.batch_size)
                    tracker.log({"val_loss": val_loss}, step=trainer.step)
                every = split.checkpoint_every
                if (every and trainer.step % every == 0) or trainer.step == split.steps:
                    trainer.save(checkpoints, extra={"loss": result.loss})
        wall = time.perf_counter() - wall_before
        idle = [
            max(0.0, 1.0 - (s["cpu_s"] - before) / wall)
            for s, before in zip(sharded.stats(), cpu_before, strict=True)
        ]
        metrics: dict[str, float] = {
            **({"val_loss": val_loss} if split.eval_every else {}),
            "final_loss": losses[-1] if losses else float("nan"),
            "first_loss": losses[0] if losses else float("nan"),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "step_ms": seconds / max(len(losses), 1) * 1e3,
            "steps": float(trainer.step),
            "idle_share": statistics.mean(idle),
            "idle_share_gpipe": bubble_fraction(split.num_stages, split.microbatches),
        }
        for rank, share in enumerate(idle, start=1):
            metrics[f"stage{rank}_idle_share"] = share
        for rank, peak in enumerate(saved_peak, start=1):  # autograd's activations, at most
            metrics[f"stage{rank}_saved_mb"] = peak / 2**20
        if split.export:
            exported = trainer.export(settings.paths.run_path / "model")
            log.info("the whole trained model, as one Hugging Face folder: %s", exported)
        tracker.summary(metrics)
        return metrics


# Locally each stage gets one core's worth, as if on its own machine.
EXPERIMENT = split_experiment(
    "split_training",
    run_driver,
    local_threads=1,
    resume="split.resume=true",
    check=check_resume,
)


def run(cfg: DictConfig | SplitTrainingRunConfig) -> dict[str, float]:
    return experiment.run(EXPERIMENT, cfg)
