"""Training across the cut: distributed autograd, DistributedOptimizer, GPipe micro-batches.

`train_step` sends every micro-batch into the pipeline at once: stage k's output for a
micro-batch is an RRef that stage k+1 fetches directly, so stage k works on micro-batch i+1
while stage k+1 works on micro-batch i (fill-drain). The last stage returns each micro-batch's
summed token loss; the driver adds them, divides by the batch's token count, and runs
`dist_autograd.backward`, which sends gradients back through the same RPCs. One
`DistributedOptimizer` step then updates every stage's parameters where they live.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.optim.optimizer import _LocalOptimizer
from torch.distributed.rpc import RRef

from lab import atomic
from split_engine import rpc_guard
from split_engine.rpc_guard import never_sent
from split_engine.sharded import ShardedModel
from split_engine.workers import StageLostError, require_driver
from split_training.config import SplitTrainConfig

log = logging.getLogger(__name__)

LATEST = "latest.json"


class StageAdamW(torch.optim.AdamW):
    """AdamW as each stage's local optimizer.

    A subclass on purpose: DistributedOptimizer swaps the stock AdamW for a TorchScript
    functional one whose state cannot be saved; this one keeps `state_dict()` (checkpoints).
    """


never_sent(StageAdamW)
never_sent(_LocalOptimizer)  # what DistributedOptimizer's RRefs point to: it holds the weights


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    seconds: float
    tokens: int


def bubble_fraction(num_stages: int, microbatches: int) -> float:
    """Idle share of each stage in a GPipe fill-drain schedule: (p-1)/(m+p-1)."""
    return (num_stages - 1) / (microbatches + num_stages - 1)


class DistributedTrainer:
    """Trains a `ShardedModel` built with `training=True`."""

    def __init__(self, sharded: ShardedModel, settings: SplitTrainConfig) -> None:
        self.sharded = sharded
        self.settings = settings
        param_rrefs = [r for refs in sharded.call_all("parameter_rrefs") for r in refs]
        if not param_rrefs:
            raise ValueError("the split model has no trainable parameters")
        quiet = logging.getLogger("torch.distributed.optim.optimizer")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # it warns that StageAdamW is not TorchScript: on purpose
        try:
            self.optimizer = DistributedOptimizer(
                StageAdamW, param_rrefs, lr=settings.lr, weight_decay=settings.weight_decay
            )
        finally:
            quiet.setLevel(level)
        self.step = 0
        self._check_tie()

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

    def _losses(self, batch: torch.Tensor, microbatches: int) -> list[torch.Tensor]:
        """Pipelined forward of `batch` (B, T): each micro-batch's summed loss, in order."""
        sharded, timeout = self.sharded, self.sharded.timeout_s
        last = len(sharded.stages) - 1
        futures = []
        for micro in batch.chunk(microbatches):  # (B/m, T) each
            positions = torch.arange(micro.shape[1]).expand_as(micro)  # (B/m, T)
            x: torch.Tensor | RRef = micro
            for index in range(last):
                x = sharded.stages[index].remote(timeout=timeout).forward(x, None, positions)
            futures.append(
                sharded.stages[last]
                .rpc_async(timeout=timeout)
                .forward(x, None, positions, labels=micro)
            )
        losses = []
        for future in futures:
            try:
                losses.append(future.wait())
            except RuntimeError as exc:
                raise StageLostError(f"a stage failed during the forward pass: {exc}") from None
        return losses

    def evaluate(self, blocks: torch.Tensor, *, batch_size: int) -> float:
        """Mean next-token loss over `blocks` (N, T): the forward alone, outside any
        distributed autograd context (nothing is recorded for a backward)."""
        total, tokens = 0.0, 0
        for batch in blocks.split(batch_size):  # (b, T)
            total += float(torch.stack(self._losses(batch, 1)).sum().detach())
            tokens += batch.shape[0] * (batch.shape[1] - 1)
        return total / tokens

    def backward(
        self, context_id: int, batch: torch.Tensor, *, microbatches: int, scale: float
    ) -> float:
        """Forward + backward of one batch in `context_id`; returns its mean token loss."""
        losses = self._losses(batch, microbatches)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        loss = torch.stack(losses).sum() / tokens
        try:
            dist_autograd.backward(context_id, [loss * scale])
        except RuntimeError as exc:
            raise StageLostError(
                f"a stage failed during the backward pass: {str(exc).splitlines()[0][:300]}"
            ) from None
        return float(loss.detach())

    def sync_tied_grads(self, context_id: int) -> None:
        """A tied embedding / LM head lives on the first and the last stage: give both copies
        the sum of their gradients, as the one matrix of the unsplit model gets, so that
        both take the identical optimizer step and stay equal bit for bit. The two stages
        exchange the gradient directly; one stage holding both ends has nothing to sync."""
        last = len(self.sharded.stages) - 1
        if last > 0:
            self.sharded.call(
                0, "sum_tied_grad", context_id, self.sharded.stages[last], self.sharded.timeout_s
            )

    def clip(self, context_id: int) -> float:
        """Global gradient norm over every stage; scales them down to `grad_clip` if above."""
        norm = math.sqrt(sum(self.sharded.call_all("grad_sq_norm", context_id)))
        limit = self.settings.grad_clip
        if limit > 0 and norm > limit:
            self.sharded.call_all("scale_grads", context_id, limit / (norm + 1e-6))
        return norm

    def _accumulate(
        self, batches: list[torch.Tensor], *, microbatches: int, finish: Callable[[int], Any]
    ) -> tuple[list[float], Any]:
        """Forward + backward of each batch, each in a distributed autograd context of its own
        (a context takes one backward); stages stash the gradients of all but the last batch and
        add them into the last context, where `finish(context_id)` then sees the sum."""
        losses = []
        for index, batch in enumerate(batches):
            with dist_autograd.context() as context_id:
                scale = 1 / len(batches)
                losses.append(
                    self.backward(context_id, batch, microbatches=microbatches, scale=scale)
                )
                if index < len(batches) - 1:
                    self.sharded.call_all("stash_grads", context_id)
                    continue
                if len(batches) > 1:
                    self.sharded.call_all("unstash_grads", context_id)
                self.sync_tied_grads(context_id)
                result = finish(context_id)
        return losses, result

    def train_step(
        self, batches: list[torch.Tensor], *, microbatches: int | None = None
    ) -> StepResult:
        """One optimizer step over `batches` (gradient accumulation: one backward each)."""
        microbatches = microbatches or self.settings.microbatches
        started = time.perf_counter()

        def finish(context_id: int) -> float:
            norm = self.clip(context_id)
            self.optimizer.step(context_id)
            return norm

        losses, norm = self._accumulate(batches, microbatches=microbatches, finish=finish)
        self.step += 1
        tokens = sum(b.numel() for b in batches)
        return StepResult(sum(losses) / len(losses), norm, time.perf_counter() - started, tokens)

    def gradients(
        self, batches: list[torch.Tensor], *, microbatches: int
    ) -> dict[str, torch.Tensor]:
        """Every stage's gradients for `batches` (prefixed `stageK.`), without stepping."""
        _, grads = self._accumulate(
            batches,
            microbatches=microbatches,
            finish=lambda context_id: self.sharded.call_all("gradients", context_id),
        )
        return {
            f"stage{k}.{name}": g for k, stage in enumerate(grads, 1) for name, g in stage.items()
        }

    # ------------------------------------------------------------------ checkpoints

    def _pairs(self) -> list[tuple[RRef, RRef]]:
        """(stage RRef, its local optimizer's RRef) per stage, matched by owner."""
        by_owner = {opt.owner().name: opt for opt in self.optimizer.remote_optimizers}
        pairs = []
        for stage in self.sharded.stages:
            if stage.owner().name not in by_owner:
                raise ValueError(f"{stage.owner().name} trains nothing, so it has no optimizer")
            pairs.append((stage, by_owner[stage.owner().name]))
        return pairs

    def _on_every_stage(self, function: Callable[[RRef, RRef, str], Any], folder: Path) -> list:
        """`function(stage, its optimizer, folder)` on every stage's own host, at once."""
        futures = [
            rpc.rpc_async(
                stage.owner(),
                function,
                args=(stage, optimizer, str(folder)),
                timeout=self.sharded.timeout_s,
            )
            for stage, optimizer in self._pairs()
        ]
        return [future.wait() for future in futures]

    def save(self, directory: Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Every stage writes its weights and optimizer state; then `latest.json` points at them.

        A crash before `latest.json` is replaced leaves the previous checkpoint the latest.
        """
        folder = directory / f"step-{self.step:06d}"
        files = self._on_every_stage(save_stage, folder)
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
        self._on_every_stage(load_stage, directory / manifest["folder"])
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


# ---------------------------------------------------------------------- run on the stage's host


def _stage_files(folder: Path) -> tuple[Path, Path]:
    name = rpc.get_worker_info().name
    return folder / f"{name}.safetensors", folder / f"{name}.optim.pt"


def save_stage(stage: RRef, optimizer: RRef, folder: str) -> list[str]:
    """On a stage's host: its trainable weights (safetensors) and optimizer state, atomically."""
    from safetensors.torch import save_file

    require_driver()
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    weights, optim = _stage_files(target)
    local = stage.local_value()
    metadata = {"start": str(local.start), "end": str(local.end)}
    atomic.replace_file(
        weights, lambda tmp: save_file(local.trainable_state(), str(tmp), metadata=metadata)
    )
    atomic.replace_file(
        optim, lambda tmp: torch.save(optimizer.local_value().optim.state_dict(), tmp)
    )
    return [weights.name, optim.name]


def load_stage(stage: RRef, optimizer: RRef, folder: str) -> None:
    from safetensors.torch import load_file

    require_driver()
    weights, optim = _stage_files(Path(folder))
    stage.local_value().load_trainable_state(load_file(str(weights)))
    state = torch.load(optim, weights_only=True)
    optimizer.local_value().optim.load_state_dict(state)


# What split training's RPCs name beyond the engine's: its stages' optimizer (built there by
# DistributedOptimizer) and its checkpoint calls; allowed in split training's processes only.
rpc_guard.allow(__name__, "StageAdamW", "load_stage", "save_stage")
