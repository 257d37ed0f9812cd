"""One worker of a data-parallel run: what torch's elastic agent starts dp.workers times on every
host, and starts again after a failure (then from the last checkpoint).

Each worker loads the same model (same weights, same seed), trains on its own slice of every
step's global batch (data_parallel.data), and takes the same optimizer step as every other:
its loss is its tokens' summed loss over the step's global token count, and the engines sum the
gradients (data_parallel.engine), so N workers with batch b compute what one process with batch
N*b computes. Each host's first worker writes the run's records in that host's run folder: the
losses are global (summed over every worker), the timings that worker's own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch.distributed.elastic.multiprocessing.errors import record

from data_parallel import checkpoint, engine
from data_parallel.checkpoint import Position
from data_parallel.config import DataParallelRunConfig, DPConfig, parse_slow_worker
from data_parallel.data import (
    Stream,
    balanced_shares,
    gather_blocks,
    global_batch,
    rank_micro_batches,
    rank_share_micro_batches,
)
from data_parallel.diloco import DiLoCo
from data_parallel.manifest import TRACE_FILE
from data_parallel.steps import StepResult, TrainsApart, Window
from data_parallel.sync_methods import Auto, sync_method
from lab import redact
from lab.cli import ConfigError
from lab.corpus import train_and_validation_blocks
from lab.device import share_of_cores, supports_bf16
from lab.losses import evaluate, next_token_loss
from lab.models import load_model, load_tokenizer
from lab.tracking import Tracker
from world.elastic import WorkerAccess, worker_group

log = logging.getLogger(__name__)

JOB = "data_parallel"


@dataclass(frozen=True)
class TrainingData:
    """What every worker trains and validates on, tokenized once by the agent."""

    train: torch.Tensor
    """(N, block_size) token ids from the stdlib corpus' training split."""
    validation: torch.Tensor
    """(dp.eval_blocks, block_size) from its held-out split."""


def training_data(settings: DataParallelRunConfig) -> TrainingData:
    """The run's blocks, as every worker of every host cuts them (a pure function of the
    corpus, the tokenizer and dp.*)."""
    dp = settings.dp
    tokenizer = load_tokenizer(settings.model, cache_dir=settings.paths.cache_path)
    train, validation = train_and_validation_blocks(
        tokenizer,
        block_size=dp.block_size,
        max_train_blocks=dp.max_train_blocks,
        eval_blocks=dp.eval_blocks,
    )
    return TrainingData(train=train, validation=validation)


def checkpoint_dir(settings: DataParallelRunConfig) -> Path:
    """Where the run keeps its checkpoints (`dp.checkpoint_dir`, or the run's own)."""
    folder = settings.dp.checkpoint_dir or settings.paths.run_path / "checkpoints"
    return Path(folder).expanduser().resolve()


def autocast_bf16(dp: DPConfig, device: torch.device) -> bool:
    """`auto`: bf16 autocast on CUDA devices that have it; `bf16` forces it where it runs."""
    if dp.mixed_precision == "none":
        return False
    if dp.mixed_precision == "bf16":
        return True
    return device.type == "cuda" and supports_bf16(device)


JOB_ENV = "DATA_PARALLEL_JOB"
"""A token the agents agree on at the rendezvous (data_parallel.launch), in every worker's
environment: a checkpoint written under it is this job's, so workers started again after a
failure, or after a host joined, go on from it, and a new job does not."""


@dataclass(frozen=True)
class World:
    """This worker's place, as the elastic agent's environment gives it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    restart: int
    """TORCHELASTIC_RESTART_COUNT: how many times this host's agent has restarted its workers
    after a failure (not after another host's failure or a host joining: those restart every
    host's workers without counting)."""
    job: str = ""
    """The job's token (JOB_ENV): the same for every worker of every round of one job."""

    @classmethod
    def from_env(cls) -> World:
        env = os.environ
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            job=env.get(JOB_ENV, ""),
        )

    @property
    def logs(self) -> bool:
        """This host's first worker writes the run's records."""
        return self.local_rank == 0


@record
def train_worker(
    settings: DataParallelRunConfig, data: TrainingData, access: WorkerAccess
) -> dict[str, float]:
    """The elastic agent's entry point (top level, so it pickles): join this round's process
    group on the world's authenticated store (`access`: world.elastic), train, leave it.
    Returns the run's metrics."""
    world = World.from_env()
    logging.basicConfig(
        level=logging.INFO if world.logs else logging.WARNING,
        format=f"[rank{world.rank}] %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(settings.num_threads or share_of_cores(world.local_world_size))
    if torch.cuda.is_available():
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        group = worker_group(access, backend="nccl", device_id=device)
    else:
        device = torch.device("cpu")
        group = worker_group(access, backend="gloo")
    with group:
        return Trainer(settings, data, world=world, device=device).run()


def due(every: int, since: int, step: int, total: int) -> bool:
    """Whether something done every `every` steps (0: never; and at the last step) fell due
    in the steps after `since` up to `step`."""
    return every > 0 and (step // every > since // every or step == total)


def make_optimizer(dp: DPConfig, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """dp.optimizer: AdamW, or SGD without momentum (DiLoCo's inner optimizer, or DDP's)."""
    if dp.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=dp.lr, weight_decay=dp.weight_decay)
    return torch.optim.AdamW(parameters, lr=dp.lr, weight_decay=dp.weight_decay)


class Trainer(TrainsApart):
    """One replica: the wrapped model, its optimizer, the data stream, its checkpoints."""

    def __init__(
        self,
        settings: DataParallelRunConfig,
        data: TrainingData,
        *,
        world: World,
        device: torch.device,
    ) -> None:
        self.settings, self.dp, self.data = settings, settings.dp, data
        self.world, self.device = world, device
        self.autocast = autocast_bf16(self.dp, device)
        self.timer = engine.CommTimer(world.world_size)
        model = self._load_model()
        self.stream = Stream(len(data.train), seed=settings.seed)
        if sync_method(self.dp.sync) is Auto:
            self._choose_sync(model)
        self.method = sync_method(self.dp.sync)
        if self.method.apart:  # every worker trains its own replica, apart
            self.model = model
        else:
            hook = functools.partial(self.method.attach, dp=self.dp, timer=self.timer)
            self.model = engine.wrap(model, engine=self.dp.engine, device=device,
                                     timer=self.timer, dp=self.dp, hook=hook)  # fmt: skip
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.dp, self.parameters)
        self.outer: DiLoCo | None = None
        self.window = Window()
        self.inner_steps = self.dp.inner_steps
        """This worker's inner steps in the current DiLoCo round (dp.balance=tokens: its speed's
        share of dp.inner_steps)."""
        self.slow = parse_slow_worker(self.dp.slow_worker)
        self.block_seconds = [0.0] * world.world_size
        """dp.balance=tokens with DDP: each worker's compute seconds a block, as measured on
        the last steps (the same numbers on every worker: they are all-reduced)."""
        self.block_compute_s = 0.0
        """This worker's own seconds a block in its last micro-step (DDP; dp.slow_worker
        sleeps FACTOR - 1 times it before the next)."""
        self.shares: list[int] = []
        """dp.balance=tokens with DDP: each worker's blocks in the current step."""
        self.cut_seconds: list[float] = []
        """dp.balance=tokens with DDP: each worker's seconds a block that cut the current step
        (0: not measured yet)."""
        self.round_steps = 0
        self.round_blocks = 0
        """DiLoCo: the blocks every worker trained on together in the last round."""
        self.round_step_s: list[float] = []
        """DiLoCo: each worker's measured seconds an inner step in the last round (what
        dp.balance=tokens cut the next round's inner steps by)."""
        if self.method.apart:
            for param in self.parameters:  # one start for every replica, as DDP's broadcast
                dist.broadcast(param.data, src=0)
            dp = self.dp
            local_tokens = dp.batch_size * dp.grad_accum_steps * (dp.block_size - 1)
            self.outer = DiLoCo(self.parameters, lr=dp.outer_lr, momentum=dp.outer_momentum,
                                nesterov=dp.outer_nesterov, wire=dp.pseudo_grad_dtype,
                                timer=self.timer, fragments=dp.fragments,
                                overlap_steps=dp.overlap_steps, mix=dp.overlap_mix,
                                reference_tokens=dp.inner_steps * local_tokens)  # fmt: skip
            self.fragment_tokens = [0.0] * dp.fragments
            """This worker's tokens since each fragment's last sync (its weight there)."""
        self.checkpoints = checkpoint_dir(settings)
        self.position = Position()
        self.restarts = 0
        self.config = redact.redact_config(asdict(self.settings))

    def _choose_sync(self, model: torch.nn.Module) -> None:
        """dp.sync=auto: measure the link and a step's compute, take the method the cost model
        predicts reaches DDP's loss first (data_parallel.autosync), say why in one line."""
        from data_parallel import autosync

        dp, world = self.dp, self.world
        first = rank_micro_batches(self.stream, 0, rank=world.rank, world_size=world.world_size,
                                   batch_size=dp.batch_size, accum=dp.grad_accum_steps)  # fmt: skip

        def compute_step() -> None:  # forward and backward of a step; the weights untouched
            for indices in first:
                ids = gather_blocks(self.data.train, indices).to(self.device)
                self._token_sum(model, ids).backward()
            model.zero_grad(set_to_none=True)

        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        method, reason = autosync.decide(world.world_size, numel, compute_step,
                                         streaming=dp.balance != "tokens",
                                         topk_fraction=dp.topk_fraction)  # fmt: skip
        self.dp = replace(dp, **autosync.settings_of(method))  # type: ignore[arg-type]
        self.settings = replace(self.settings, dp=self.dp)
        if world.rank == 0:
            log.info("%s", reason)

    def _load_model(self) -> torch.nn.Module:
        """The same weights on every worker: the configured model, in fp32 (`auto`; bf16 comes
        from autocast), LoRA adapters seeded alike where dp.lora is set."""
        cfg = self.settings.model
        if cfg.dtype == "auto":
            cfg = replace(cfg, dtype="float32")
        torch.manual_seed(self.settings.seed)
        model = load_model(
            cfg, cache_dir=self.settings.paths.cache_path, device=self.device, for_training=True
        )
        if self.dp.lora:
            from peft import LoraConfig, inject_adapter_in_model

            lora = self.settings.lora
            config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                target_modules=list(lora.target_modules))  # fmt: skip
            model = inject_adapter_in_model(config, model)
            for name, param in model.named_parameters():
                param.requires_grad_("lora_" in name)
        return model

    # ------------------------------------------------------------------ one step

    def _token_sum(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The summed next-token loss of `ids` (b, T) under `model`, autocast as configured."""
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            logits = model(input_ids=ids, use_cache=False).logits  # (b, T, V)
        return next_token_loss(logits, ids, reduction="sum")

    def _slow_down(self, seconds: float) -> float:
        """dp.slow_worker: this worker takes FACTOR times as long as it did; returns the
        seconds slept."""
        if self.slow is None or self.slow[0] != self.world.rank:
            return 0.0
        extra = (self.slow[1] - 1.0) * seconds
        time.sleep(extra)
        return extra

    def _micro_batches(self) -> list[list[int]]:
        """This worker's blocks of the step, micro-batch by micro-batch: its slice of each
        micro-step, or (dp.balance=tokens) its speed's share of the step in one piece."""
        dp, world = self.dp, self.world
        if dp.balance == "tokens":
            total = global_batch(world.world_size, dp.batch_size, dp.grad_accum_steps)
            self.cut_seconds = list(self.block_seconds)  # what this step's cut follows
            self.shares = balanced_shares(self.cut_seconds, total)
            return rank_share_micro_batches(self.stream, self.position.blocks,
                                            shares=self.shares, rank=world.rank,
                                            batch_size=dp.batch_size)  # fmt: skip
        return rank_micro_batches(self.stream, self.position.blocks, rank=world.rank,
                                  world_size=world.world_size, batch_size=dp.batch_size,
                                  accum=dp.grad_accum_steps)  # fmt: skip

    def step(self) -> StepResult:
        """One optimizer step over the next global batch of the stream."""
        if self.outer is not None:
            return self.step_apart()
        dp, world = self.dp, self.world
        micro = self._micro_batches()
        global_tokens = global_batch(world.world_size, dp.batch_size, dp.grad_accum_steps) * (
            dp.block_size - 1
        )
        self.timer.reset()
        started = time.perf_counter()
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        compute_s = 0.0
        """This worker's own forward and backward seconds (and dp.slow_worker's sleep), not
        its wait for the others' gradients: dp.balance=tokens cuts the next step by it."""
        for index, indices in enumerate(micro):
            ids = gather_blocks(self.data.train, indices).to(self.device)  # (b, T)
            last = index == len(micro) - 1
            # dp.slow_worker: slow before its gradients are ready, as a slower machine is (a
            # sleep after the backward would hold the next collective instead)
            compute_s += self._slow_down(self.block_compute_s * len(indices))
            computing = time.perf_counter()
            with engine.micro_step(self.model, engine=dp.engine, sync=last):
                token_sum = self._token_sum(self.model, ids)
                (token_sum / global_tokens).backward()
            synced = time.perf_counter()
            computed = self.timer.ready if last and self.timer.ready else synced
            compute_s += computed - computing
            self.block_compute_s = (computed - computing) / len(indices)
            local_sum += token_sum.detach().double()
        grad_norm = engine.clip_gradients(self.parameters, dp.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the step's loss, summed over the workers; with dp.balance=tokens each worker's
        # seconds a block ride along (one collective either way)
        sums = torch.zeros(1 + world.world_size, dtype=torch.float64, device=self.device)
        sums[0] = local_sum
        sums[1 + world.rank] = compute_s / max(1, sum(len(m) for m in micro))
        sums = self.timer.all_reduce(sums if dp.balance == "tokens" else sums[:1])
        loss = float(sums[0].item()) / global_tokens
        if dp.balance == "tokens":
            measured = sums[1:].tolist()
            # smoothed over the last steps: two busy cores make one step's time noisy
            pairs = zip(measured, self.block_seconds, strict=True)
            self.block_seconds = [m if not old > 0 else (m + old) / 2 for m, old in pairs]
        step_ms = (time.perf_counter() - started) * 1e3
        comm_ms = min(self.timer.in_flight_s() * 1e3, step_ms)
        blocks = global_batch(world.world_size, dp.batch_size, dp.grad_accum_steps)
        self.position = Position(
            step=self.position.step + 1,
            blocks=self.position.blocks + blocks,
            tokens=self.position.tokens + blocks * dp.block_size,
            wall_s=self.position.wall_s + step_ms / 1e3,
        )
        return StepResult(loss, grad_norm, step_ms, comm_ms, self.timer.collective_bytes,
                          self.timer.wire_bytes, self.timer.collectives,
                          synced_ms=(synced - started) * 1e3,
                          trace=self.timer.trace(started))  # fmt: skip

    def evaluate(self) -> float:
        """Mean next-token loss on the held-out blocks; every worker computes it on the same
        blocks (FSDP2's forward is a collective: every worker must run it)."""
        module = engine.inner(self.model)
        with (
            self.outer.global_model() if self.outer is not None else contextlib.nullcontext(),
            torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast),
        ):
            loss = evaluate(module, self.data.validation, batch_size=self.dp.batch_size)
        module.train()
        return loss

    # ------------------------------------------------------------------ the run

    def restore(self) -> bool:
        """Go on from the latest checkpoint: with dp.resume, or when this job wrote it (the
        workers were started again, after a failure or a host joining). Every worker decides
        alike: they read the same folder. True when a restarted job went on."""
        folder = checkpoint.latest(self.checkpoints)
        ours = folder is not None and bool(self.world.job)
        ours = ours and checkpoint.job_of(folder) == self.world.job  # type: ignore[arg-type]
        if folder is None or not (self.dp.resume or ours):
            if self.world.restart:
                log.warning("restart %d: no checkpoint of this job yet in %s, starting over",
                            self.world.restart, self.checkpoints)  # fmt: skip
            return False
        self.position = checkpoint.load(folder, self.model, self.optimizer, outer=self._outer_opt())
        if self.outer is not None:
            self.outer.reset_anchor()  # the checkpoint's model is the global one
        self._restore_rank_state(folder)
        log.info("resumed from step %d (%s), %d workers", self.position.step, folder,
                 self.world.world_size)  # fmt: skip
        return ours and not self.dp.resume

    def _restore_rank_state(self, folder: Path) -> None:
        """This worker's own part of the checkpoint in `folder`: a DDP hook's state (top-k's
        residuals, PowerSGD's), streaming DiLoCo's own parameters and syncs in flight. A rank
        the checkpoint lacks (it was written by fewer workers) takes what every worker shares
        from rank 0's part and starts its own afresh."""
        hook = getattr(self.model, "lab_hook_state", None)
        if hook is None and (self.outer is None or not self.outer.streaming):
            return
        saved, own = checkpoint.load_rank_state(folder), True
        if saved is None:
            saved, own = checkpoint.load_rank_state(folder, rank=0), False
            if saved is None:
                return
            log.warning("rank %d: no state of this rank in %s (written by fewer workers): its "
                        "error feedback (or its own DiLoCo parameters) start afresh",
                        self.world.rank, folder)  # fmt: skip
        outer_part = {k.split("/", 1)[1]: v for k, v in saved.items() if k.startswith("diloco/")}
        if hook is not None:
            hook.load_state_dict({k: v for k, v in saved.items() if not k.startswith("diloco/")},
                                 own=own)  # fmt: skip
        if self.outer is not None and self.outer.streaming:
            fragments = int(outer_part.get("fragments", torch.tensor(1)))
            if fragments != self.dp.fragments:
                raise ConfigError(
                    f"the checkpoint in {folder} was written with dp.fragments={fragments}: "
                    "resume it with the same (its syncs in flight are by fragment)"
                )
            self.outer.load_state_dict(outer_part, own=own)
            if "fragment_tokens" in outer_part:
                self.fragment_tokens = outer_part["fragment_tokens"].tolist()

    def save(self) -> None:
        rank_state = self._rank_state()  # before the model is set to the global one
        with self.outer.global_model() if self.outer is not None else contextlib.nullcontext():
            checkpoint.save(self.checkpoints, self.model, self.optimizer, self.position,
                            config=self.config, job=self.world.job, outer=self._outer_opt(),
                            rank_state=rank_state)  # fmt: skip

    def _rank_state(self) -> dict[str, torch.Tensor] | None:
        hook = getattr(self.model, "lab_hook_state", None)
        state = dict(hook.state_dict()) if hook is not None else {}
        if self.outer is not None and self.outer.streaming:
            state.update({f"diloco/{k}": v for k, v in self.outer.state_dict().items()})
            state["diloco/fragments"] = torch.tensor(self.dp.fragments)
            state["diloco/fragment_tokens"] = torch.tensor(self.fragment_tokens,
                                                           dtype=torch.float64)  # fmt: skip
        return state or None

    def _outer_opt(self) -> torch.optim.Optimizer | None:
        return None if self.outer is None else self.outer.outer

    def run(self) -> dict[str, float]:
        dp, world = self.dp, self.world
        if world.local_world_size != world.world_size:  # more than one host
            checkpoint.check_shared(self.checkpoints)
        restarted = self.restore()
        if dp.init_from and self.position.step == 0:  # a warm start, not a resume
            warm = Path(dp.init_from).expanduser().resolve()
            at = checkpoint.load_weights(warm, self.model)
            if self.outer is not None:
                self.outer.reset_anchor()
            # the data goes on where the warm start stopped: its batches are not trained twice
            self.position = Position(blocks=at.blocks)
            log.info("warm start: the weights of %s (step %d), the data from block %d", warm,
                     at.step, at.blocks)  # fmt: skip
        # the group's restarts: the host whose worker failed counts one, the others none
        counted = torch.tensor([world.restart], dtype=torch.int64, device=self.device)
        dist.all_reduce(counted, op=dist.ReduceOp.MAX)
        self.restarts = int(counted.item())
        tracker = Tracker.from_settings(self.settings, job=JOB) if world.logs else None
        results: list[StepResult] = []
        val_loss = float("nan")
        with tracker or contextlib.nullcontext():  # closed as failed if anything raises
            if tracker is not None and restarted:
                tracker.log({"restart": self.restarts}, step=self.position.step)
            progress = Progress(
                TextColumn(JOB),
                BarColumn(),
                TextColumn("step {task.completed}/{task.total} loss {task.fields[loss]}"),
                TimeRemainingColumn(),
                disable=tracker is None,
            )
            with progress:
                task = progress.add_task("train", total=dp.steps, completed=self.position.step,
                                         loss="-")  # fmt: skip
                last_sync = self.position.step
                while self.position.step < dp.steps:
                    result = self.step()
                    results.append(result)
                    step = self.position.step
                    if tracker is not None:
                        tracker.log(self._record(result), step=step)
                        self._trace(result, step)
                    shown = result.loss if result.loss == result.loss else result.worker_loss
                    progress.update(task, completed=step, loss=f"{shown:.3f}")
                    at_sync = self.outer is None or self.sync_due(step)
                    # DiLoCo: the global model exists at syncs only; they take what fell due
                    since = last_sync
                    if at_sync:
                        last_sync = step
                    reached = False
                    if at_sync and due(dp.eval_every, since, step, dp.steps):
                        val_loss = self.evaluate()
                        reached = self._reached(val_loss)
                        if tracker is not None:
                            tracker.log({"val_loss": val_loss}, step=step)
                    if at_sync and (
                        due(dp.checkpoint_every, since, step, dp.steps)
                        or step == dp.steps
                        or reached
                    ):
                        self.save()
                    if reached:
                        log.info("validation loss %.4f reached dp.target_val_loss=%g at step %d: "
                                 "done", val_loss, dp.target_val_loss, step)  # fmt: skip
                        break
            metrics = self._summary(results, val_loss)
            if tracker is not None:
                tracker.summary(metrics)
            return metrics

    def _reached(self, val_loss: float) -> bool:
        """dp.target_val_loss met, as rank 0 measured it (every worker ends at the same step,
        even where two CPUs round a loss apart)."""
        if self.dp.target_val_loss <= 0:
            return False
        flag = torch.tensor([float(val_loss <= self.dp.target_val_loss)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _trace(self, result: StepResult, step: int) -> None:
        """One line of `<run dir>/comm_trace.jsonl`: when the step's collectives ran (the cost
        model's input, data_parallel.manifest)."""
        line = {"step": step, "workers": self.world.world_size, "step_ms": result.step_ms,
                "synced_ms": result.synced_ms, "collectives": result.trace}  # fmt: skip
        with (self.settings.paths.run_path / TRACE_FILE).open("a") as out:
            out.write(json.dumps(line) + "\n")

    def _record(self, result: StepResult) -> dict[str, Any]:
        record = self._step_record(result)
        if self.outer is None:
            return record
        # DiLoCo: the global loss exists at syncs; between them, this worker's own
        record["worker_loss"] = result.worker_loss
        for key in ("loss", "grad_norm", "worker_loss"):
            if record[key] != record[key]:  # NaN: not computed this step
                del record[key]
        if "loss" in record:
            record["inner_steps"] = self.round_steps
            record["round_blocks"] = self.round_blocks
            if self.dp.balance == "tokens":  # what cut the next round's inner steps
                record.update({f"worker{r}_step_s": s for r, s in enumerate(self.round_step_s)})
        return record

    def _step_record(self, result: StepResult) -> dict[str, Any]:
        shares: dict[str, float] = {}
        if self.outer is None and self.shares:  # dp.balance=tokens: who trained what
            shares["own_blocks"] = self.shares[self.world.rank]
            shares["fewest_blocks"] = min(self.shares)
            shares |= {f"worker{r}_block_s": s for r, s in enumerate(self.cut_seconds)}
        return {
            **shares,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "step_ms": result.step_ms,
            "compute_ms": result.step_ms - result.comm_ms,
            "comm_ms": result.comm_ms,
            "comm_bytes": result.comm_bytes,
            "wire_bytes": result.wire_bytes,
            "collectives": result.collectives,
            "tokens": self.position.tokens,
            "wall_s": self.position.wall_s,
            "workers": self.world.world_size,
        }

    def sync_label(self) -> str:
        """The sync method that ran (dp.sync=auto: the one it chose), with its settings."""
        return self.method.label(self.dp)

    def _summary(self, results: list[StepResult], val_loss: float) -> dict[str, Any]:
        """The final table: losses, then the step's time and traffic (the first step, a
        warm-up, left out when there are others)."""
        timed = results[1:] or results
        if not timed:  # restarted after the last step's checkpoint: nothing left to measure
            return {"steps": float(self.position.step), "restarts": float(self.restarts)}
        # DiLoCo's steps are uneven (a sync every dp.inner_steps): its means, DDP's medians
        middle = statistics.median if self.outer is None else statistics.fmean
        step_ms = middle(r.step_ms for r in timed)
        comm_ms = middle(r.comm_ms for r in timed)
        tokens = global_batch(self.world.world_size, self.dp.batch_size,
                              self.dp.grad_accum_steps) * self.dp.block_size  # fmt: skip
        synced = [r for r in results if r.loss == r.loss]
        extra = {}
        if self.outer is not None:
            extra = {"inner_steps": float(self.dp.inner_steps), "syncs": float(len(synced)),
                     "comm_bytes": sum(r.comm_bytes for r in timed) / len(timed),
                     "wire_bytes": sum(r.wire_bytes for r in timed) / len(timed)}  # fmt: skip
        return {
            "sync": self.sync_label(),
            "final_loss": synced[-1].loss if synced else float("nan"),
            "first_loss": synced[0].loss if synced else float("nan"),
            **({"val_loss": val_loss} if self.dp.eval_every else {}),
            "tokens_per_s": tokens * len(timed) / (sum(r.step_ms for r in timed) / 1e3),
            "step_ms": step_ms,
            "compute_ms": step_ms - comm_ms,
            "comm_ms": comm_ms,
            "comm_share": comm_ms / step_ms if step_ms else 0.0,
            "comm_bytes": float(timed[-1].comm_bytes),
            "wire_bytes": float(timed[-1].wire_bytes),
            "collectives": float(timed[-1].collectives),
            "workers": float(self.world.world_size),
            "steps": float(self.position.step),
            "restarts": float(self.restarts),
            "sent_bytes": float(sum(r.wire_bytes for r in results)),
            **extra,
        }
