"""Training across the cut: the driver's side of `split_training.pipeline`.

The driver cuts the step's batches into micro-batches and starts the step on every stage at
once; the stages run the forwards and backwards among themselves, agree on the global gradient
norm, clip and step their own optimizers, and answer with the losses (see the pipeline module
for the messages and why not torch's distributed autograd).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

from lab import atomic
from split_engine.liveness import PeerWatch, heartbeat_timeout_s
from split_engine.sharded import ShardedModel, wait_all
from split_training.config import SplitTrainConfig
from split_training.pipeline import PipelineStage, Plan

log = logging.getLogger(__name__)

LATEST = "latest.json"


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    seconds: float
    tokens: int
    saved_peak_bytes: list[int]
    """Per stage: the most bytes autograd held for the backward at once (activations)."""


def bubble_fraction(num_stages: int, microbatches: int) -> float:
    """Idle share of each stage in a fill-drain schedule (GPipe or 1F1B): (p-1)/(m+p-1)."""
    return (num_stages - 1) / (microbatches + num_stages - 1)


class DistributedTrainer:
    """Trains a `ShardedModel` built with `training=True`."""

    def __init__(
        self,
        sharded: ShardedModel,
        settings: SplitTrainConfig,
        *,
        sync_tied: bool = True,
        watch: PeerWatch | None = None,
    ) -> None:
        """`watch`: the driver's over its stages (what `driving` yields), checked every
        liveness.WATCH_S while a step waits for the stages' answers."""
        self.sharded = sharded
        self.settings = settings
        self.watch = watch
        hyper = {
            "schedule": settings.schedule,
            "lr": settings.lr,
            "weight_decay": settings.weight_decay,
            "grad_clip": settings.grad_clip,
            "sync_tied": sync_tied,
            "heartbeat_timeout_s": heartbeat_timeout_s(settings),
        }
        stages = sharded.stages
        self.pipes: list[RRef] = [
            rpc.remote(
                stage.owner(),
                PipelineStage,
                args=(stage, index, len(stages), hyper, sharded.timeout_s),
                timeout=sharded.timeout_s,
            )
            for index, stage in enumerate(stages)
        ]
        counts = self._on_every_pipe("connect", self.pipes)
        if not sum(counts):
            raise ValueError("the split model has no trainable parameters")
        self.step = 0
        self._sequence = 0
        """Each pipeline call's number on the wire (checkpoint steps may start anywhere)."""
        self._check_tie()

    def _on_every_pipe(self, method: str, *args: Any) -> list:
        """`method(*args)` on every stage's pipeline at once; results in stage order. Where one
        fails, the others are waited for, then the first failure is raised."""
        timeout = self.sharded.timeout_s
        futures = [getattr(pipe.rpc_async(timeout=timeout), method)(*args) for pipe in self.pipes]
        results, failed = wait_all(futures, watch=self.watch)
        if failed is not None:
            raise self.sharded._lost(*failed) from None
        return results

    def _check_tie(self) -> None:
        """Refuse to train a tied model whose two ends the stages did not load equal: the run
        could not keep the tie, and would silently train a different, untied model."""
        last = len(self.sharded.stages) - 1
        if last == 0:
            return
        first_end = self.sharded.call(0, "tied_weight")
        last_end = self.sharded.call(last, "tied_weight")
        if first_end is None and last_end is None:
            return  # not tied, or the matrix is frozen (LoRA)
        if first_end is None or last_end is None or not torch.equal(first_end, last_end):
            raise ValueError(
                "this model ties its input embedding and LM head, but the first and last "
                "stages did not load equal copies of it, so the split run cannot keep the "
                "tie; refusing to train an untied model instead"
            )

    # ------------------------------------------------------------------ one step

    def evaluate(self, blocks: torch.Tensor, *, batch_size: int) -> float:
        """Mean next-token loss over `blocks` (N, T): the forward alone, down the chain of
        stages (each hands its output to the next) and back with the summed loss."""
        total, tokens = 0.0, 0
        for batch in blocks.split(batch_size):  # (b, T)
            positions = torch.arange(batch.shape[1]).expand_as(batch)  # (b, T)
            total += float(self.sharded.run_stages(batch, None, positions, labels=batch))
            tokens += batch.shape[0] * (batch.shape[1] - 1)
        return total / tokens

    def _run(
        self, batches: list[torch.Tensor], *, microbatches: int, apply: bool
    ) -> tuple[list[dict[str, Any]], float]:
        """One pipeline step over `batches` (each (B, T), one backward each, gradients summed):
        every stage's answer, and the mean token loss."""
        shapes = {tuple(b.shape) for b in batches}
        if len(shapes) != 1:
            raise ValueError(f"the accumulated batches differ in shape: {sorted(shapes)}")
        rows, length = shapes.pop()
        if rows % microbatches:
            raise ValueError(f"a batch of {rows} rows does not cut into {microbatches} parts")
        plan = Plan(
            step=self._sequence,
            batches=len(batches),
            microbatches=microbatches,
            rows=rows // microbatches,
            tokens=length,
            apply=apply,
        )
        self._sequence += 1
        tokens = torch.stack(batches)  # (n, B, T)
        per_batch = rows * (length - 1)
        scales = [1.0 / (per_batch * len(batches))] * len(batches)
        last = len(self.pipes) - 1
        # each stage may wait a timeout for each message of the step, and for its last answer
        timeout = self.sharded.timeout_s * (2 * microbatches * len(batches) + 4)
        futures = [
            pipe.rpc_async(timeout=timeout).train_step(
                asdict(plan), tokens if index in (0, last) else None, scales
            )
            for index, pipe in enumerate(self.pipes)
        ]
        answers, failed = wait_all(futures, watch=self.watch)
        if failed is not None:  # a stage that is gone by name, else the stage's own reason
            raise self.sharded._lost(*failed, call="the training step") from None
        loss = sum(answers[last]["losses"]) / (per_batch * len(batches))
        return answers, loss

    def train_step(
        self, batches: list[torch.Tensor], *, microbatches: int | None = None
    ) -> StepResult:
        """One optimizer step over `batches` (gradient accumulation: one backward each)."""
        started = time.perf_counter()
        answers, loss = self._run(
            batches, microbatches=microbatches or self.settings.microbatches, apply=True
        )
        self.step += 1
        return StepResult(
            loss,
            float(answers[0]["grad_norm"]),
            time.perf_counter() - started,
            sum(b.numel() for b in batches),
            [int(a["saved_peak_bytes"]) for a in answers],
        )

    def gradients(
        self, batches: list[torch.Tensor], *, microbatches: int
    ) -> dict[str, torch.Tensor]:
        """Every stage's gradients for `batches` (prefixed `stageK.`), without stepping."""
        answers, _ = self._run(batches, microbatches=microbatches, apply=False)
        return {
            f"stage{k}.{name}": g
            for k, answer in enumerate(answers, 1)
            for name, g in answer["gradients"].items()
        }

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Every stage writes its weights and optimizer state; then `latest.json` points at them.

        A crash before `latest.json` is replaced leaves the previous checkpoint the latest.
        """
        folder = directory / f"step-{self.step:06d}"
        files = self._on_every_pipe("save", str(folder))
        manifest = {
            "step": self.step,
            "folder": folder.name,
            "ranges": [list(r) for r in self.sharded.ranges],
            "files": files,
            **(extra or {}),
        }
        directory.mkdir(parents=True, exist_ok=True)
        atomic.write_text(directory / LATEST, json.dumps(manifest, indent=1))
        return folder

    def load(self, directory: Path) -> dict[str, Any]:
        """Restore every stage from the latest checkpoint in `directory`; returns its manifest."""
        path = directory / LATEST
        if not path.is_file():
            raise FileNotFoundError(f"split.resume=true but {path} does not exist")
        manifest = json.loads(path.read_text())
        ranges = [tuple(r) for r in manifest["ranges"]]
        if ranges != list(self.sharded.ranges):
            raise ValueError(
                f"the checkpoint was cut as {ranges}, this run as {self.sharded.ranges}: "
                f"resume with the same split.boundaries / num_stages"
            )
        self._on_every_pipe("load", str(directory / manifest["folder"]))
        weight = self.sharded.call(0, "tied_weight")  # stored once, on the first stage
        if weight is not None and len(self.sharded.stages) > 1:
            self.sharded.call(len(self.sharded.stages) - 1, "set_tied_weight", weight)
        self.step = int(manifest["step"])
        return manifest

    def export(self, folder: Path) -> Path:
        """Write the whole model as it stands as one Hugging Face folder (config, tokenizer,
        model.safetensors) that `from_pretrained` loads; a tied matrix is saved once and
        loads tied."""
        from transformers import AutoConfig, AutoModelForCausalLM

        state: dict[str, torch.Tensor] = {}
        for part in self.sharded.call_all("export_state"):
            state.update(part)
        files = self.sharded.call(0, "model_files")
        if "config.json" not in files:
            raise ValueError("the first stage's model folder has no config.json to export with")
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()  # the head takes the embedding's tensor where the config ties them
        missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
        if missing:
            raise ValueError(f"the stages hold no tensors for {missing[:4]}")
        model.save_pretrained(folder)
        return folder
