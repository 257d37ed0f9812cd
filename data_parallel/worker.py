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
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch.distributed.elastic.multiprocessing.errors import record

from data_parallel import checkpoint, engine
from data_parallel.checkpoint import Position
from data_parallel.config import DataParallelRunConfig, DPConfig
from data_parallel.data import Stream, gather_blocks, global_batch, rank_micro_batches
from data_parallel.manifest import TRACE_FILE
from data_parallel.network import listening_store
from lab import redact
from lab.corpus import train_and_validation_blocks
from lab.device import share_of_cores, supports_bf16
from lab.losses import evaluate, next_token_loss
from lab.models import load_model, load_tokenizer
from lab.tracking import Tracker

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
def train_worker(settings: DataParallelRunConfig, data: TrainingData) -> dict[str, float]:
    """The elastic agent's entry point (top level, so it pickles): join the process group,
    train, leave it. Returns the run's metrics."""
    world = World.from_env()
    logging.basicConfig(
        level=logging.INFO if world.logs else logging.WARNING,
        format=f"[rank{world.rank}] %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(settings.num_threads or share_of_cores(world.local_world_size))
    # rank 0 hosts the workers' store on the address its agent told the others, not on every
    # interface (init_process_group's own TCPStore(is_master=True) then shares this one)
    _store = listening_store(*master_address()) if world.rank == 0 else None
    if torch.cuda.is_available():
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return Trainer(settings, data, world=world, device=device).run()
    finally:
        dist.destroy_process_group()


def master_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, as the agent sets them (the workers' store)."""
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_ms: float
    comm_ms: float
    comm_bytes: int
    wire_bytes: float
    collectives: int
    synced_ms: float = 0.0
    """When the step's synchronising backward returned (DDP: every bucket reduced), ms after
    the step began."""
    trace: list[list[float]] = field(default_factory=list)
    """Its collectives: [launched, completed] ms after the step began, and bytes."""


class Trainer:
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
        self.model = engine.wrap(self._load_model(), engine=self.dp.engine, device=device,
                                 timer=self.timer, sync=self.dp.sync, dp=self.dp)  # fmt: skip
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=self.dp.lr, weight_decay=self.dp.weight_decay
        )
        self.stream = Stream(len(data.train), seed=settings.seed)
        self.checkpoints = checkpoint_dir(settings)
        self.position = Position()
        self.restarts = 0
        self.config = redact.redact_config(asdict(settings))

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

    def step(self) -> StepResult:
        """One optimizer step over the next global batch of the stream."""
        dp, world = self.dp, self.world
        micro = rank_micro_batches(
            self.stream,
            self.position.blocks,
            rank=world.rank,
            world_size=world.world_size,
            batch_size=dp.batch_size,
            accum=dp.grad_accum_steps,
        )
        global_tokens = global_batch(world.world_size, dp.batch_size, dp.grad_accum_steps) * (
            dp.block_size - 1
        )
        self.timer.reset()
        started = time.perf_counter()
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for index, indices in enumerate(micro):
            ids = gather_blocks(self.data.train, indices).to(self.device)  # (b, T)
            last = index == len(micro) - 1
            with engine.micro_step(self.model, engine=dp.engine, sync=last):
                with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
                    logits = self.model(input_ids=ids, use_cache=False).logits  # (b, T, V)
                token_sum = next_token_loss(logits, ids, reduction="sum")
                (token_sum / global_tokens).backward()
            synced = time.perf_counter()
            local_sum += token_sum.detach().double()
        grad_norm = engine.clip_gradients(self.parameters, dp.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = float(self.timer.all_reduce(local_sum).item()) / global_tokens
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
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
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
        self.position = checkpoint.load(folder, self.model, self.optimizer)
        log.info("resumed from step %d (%s), %d workers", self.position.step, folder,
                 self.world.world_size)  # fmt: skip
        return ours and not self.dp.resume

    def save(self) -> None:
        checkpoint.save(self.checkpoints, self.model, self.optimizer, self.position,
                        config=self.config, job=self.world.job)  # fmt: skip

    def run(self) -> dict[str, float]:
        dp, world = self.dp, self.world
        if world.local_world_size != world.world_size:  # more than one host
            checkpoint.check_shared(self.checkpoints)
        restarted = self.restore()
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
                while self.position.step < dp.steps:
                    result = self.step()
                    results.append(result)
                    step = self.position.step
                    if tracker is not None:
                        tracker.log(self._record(result), step=step)
                        self._trace(result, step)
                    progress.update(task, completed=step, loss=f"{result.loss:.3f}")
                    if dp.eval_every and (step % dp.eval_every == 0 or step == dp.steps):
                        val_loss = self.evaluate()
                        if tracker is not None:
                            tracker.log({"val_loss": val_loss}, step=step)
                    every = dp.checkpoint_every
                    if (every and step % every == 0) or step == dp.steps:
                        self.save()
            metrics = self._summary(results, val_loss)
            if tracker is not None:
                tracker.summary(metrics)
            return metrics

    def _trace(self, result: StepResult, step: int) -> None:
        """One line of `<run dir>/comm_trace.jsonl`: when the step's collectives ran (the cost
        model's input, data_parallel.manifest)."""
        line = {"step": step, "workers": self.world.world_size, "step_ms": result.step_ms,
                "synced_ms": result.synced_ms, "collectives": result.trace}  # fmt: skip
        with (self.settings.paths.run_path / TRACE_FILE).open("a") as out:
            out.write(json.dumps(line) + "\n")

    def _record(self, result: StepResult) -> dict[str, Any]:
        return {
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

    def _summary(self, results: list[StepResult], val_loss: float) -> dict[str, float]:
        """The final table: losses, then the step's time and traffic (the first step, a
        warm-up, left out when there are others)."""
        timed = results[1:] or results
        if not timed:  # restarted after the last step's checkpoint: nothing left to measure
            return {"steps": float(self.position.step), "restarts": float(self.restarts)}
        step_ms = statistics.median(r.step_ms for r in timed)
        comm_ms = statistics.median(r.comm_ms for r in timed)
        tokens = global_batch(self.world.world_size, self.dp.batch_size,
                              self.dp.grad_accum_steps) * self.dp.block_size  # fmt: skip
        return {
            "final_loss": results[-1].loss,
            "first_loss": results[0].loss,
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
        }
