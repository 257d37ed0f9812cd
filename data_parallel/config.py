"""data_parallel's config schema (`conf/data_parallel.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from data_parallel.sync_methods import SyncMethod, sync_method
from lab.config import (
    LabConfig,
    LoRASettings,
    check_choice,
    check_fields_positive,
    check_positive,
)

ENGINES = ("ddp", "fsdp")
OPTIMIZERS = ("adamw", "sgd")
PSEUDO_GRAD_DTYPES = ("fp32", "fp16", "int8")
BALANCES = ("none", "tokens")
MIXED_PRECISIONS = ("auto", "bf16", "none")


def parse_nnodes(value: str) -> tuple[int, int]:
    """`dp.nnodes` as (min, max) hosts: `2` is (2, 2), `2:3` is (2, 3). ValueError naming the
    key otherwise."""
    text = str(value).strip()
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise ValueError(
            f"dp.nnodes={value!r} must be N or MIN:MAX (hosts), e.g. 2 or 2:3"
        ) from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"dp.nnodes={value!r} must have 1 <= MIN <= MAX")
    return bounds


def parse_slow_worker(value: str) -> tuple[int, float] | None:
    """`dp.slow_worker` as (rank, factor), None when empty; ValueError naming the key."""
    text = str(value).strip()
    if not text:
        return None
    rank, sep, factor = text.partition(":")
    try:
        parsed = (int(rank), float(factor))
    except ValueError:
        parsed = (-1, 0.0)
    if not sep or parsed[0] < 0 or not 1.0 <= parsed[1] <= 100.0:
        raise ValueError(
            f"dp.slow_worker={value!r} must be RANK:FACTOR, RANK >= 0 and FACTOR in [1, 100] "
            "(1:2 makes worker 1 take twice as long a micro-step)"
        )
    return parsed


@dataclass
class DPConfig:
    """How the replicas are launched, fed and kept in step."""

    workers: int = 2
    """Worker processes on this host (torchrun's nproc_per_node): a local run's all of them,
    a `role=worker` host's own."""
    engine: str = "ddp"
    """ddp: DistributedDataParallel, every worker holds the whole model; fsdp: FSDP2
    (`fully_shard`), parameters, gradients and optimizer state sharded across workers."""
    sync: str = "ddp"
    """How DDP's gradient buckets are synchronised: ddp, a SUM all-reduce of each in fp32;
    fp16 / bf16, torch's compression hooks (half the bytes; refused where this torch's gloo
    sums that dtype wrong); powersgd, torch's PowerSGD hook (low-rank factors, the powersgd_*
    settings); none, a no-op hook (each worker keeps its own gradients: not data-parallel
    training, the baseline bench/data_parallel_bench.py subtracts to find what communication
    costs); topk; diloco; auto. Each is registered in data_parallel/sync_methods.py."""
    inner_steps: int = 50
    """dp.sync=diloco: H, the steps each worker takes on its own between two syncs of the
    model (data_parallel/diloco.py)."""
    outer_lr: float = 0.7
    """dp.sync=diloco: the outer SGD's learning rate, applied to the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """dp.sync=diloco: the outer SGD's momentum (Nesterov's when outer_nesterov; 0: plain SGD)."""
    outer_nesterov: bool = True
    fragments: int = 1
    """dp.sync=diloco: the model cut into this many fragments (contiguous runs of parameters
    of about equal size), each synced once every dp.inner_steps steps, at staggered steps
    (streaming DiLoCo): each sync sends 1/fragments of the model, so the link's peak load falls
    by that factor. 1: the whole model at once."""
    overlap_steps: int = 0
    """dp.sync=diloco: inner steps a sync runs behind (tau): its all-reduce starts and the
    workers train on; it lands this many steps later, mixed with what each worker trained
    meanwhile (dp.overlap_mix). 0: the workers wait for it."""
    overlap_mix: float = 0.5
    """dp.overlap_steps > 0: the share of a worker's own parameters kept when a late sync
    lands (alpha * own + (1 - alpha) * global; 0 takes the global ones)."""
    pseudo_grad_dtype: str = "fp32"
    """dp.sync=diloco: how the pseudo-gradient crosses: fp32, fp16 (half the bytes), int8 (one
    scale per worker, all-gathered: its bytes grow with the workers)."""
    balance: str = "none"
    """none: every worker trains the same tokens a step; tokens: each worker's share follows its
    measured speed, so a slow machine does not hold the others back: with DiLoCo its inner
    steps a round, the pseudo-gradients averaged weighted by the tokens each trained on; with
    DDP its blocks of each step's global batch (the same batch, so the same gradient: only who
    computes which blocks changes)."""
    slow_worker: str = ""
    """RANK:FACTOR: worker RANK takes FACTOR times as long a micro-step (it sleeps the
    difference: with DDP before each micro-step, FACTOR - 1 times its last one's time a block,
    so its gradients are late as a slower machine's are): an uneven pair of machines on one,
    to measure dp.balance with. "" = none."""
    bucket_cap_mb: float = 25.0
    """DDP's gradient bucket size (MiB; torch's default 25): each bucket is one collective, so
    fewer, larger buckets pay the link's delays fewer times, smaller ones overlap more of the
    backward."""
    topk_fraction: float = 0.01
    """dp.sync=topk: the share of each bucket's entries a worker sends a step (the rest waits in
    its error feedback)."""
    powersgd_rank: int = 4
    """PowerSGD's matrix approximation rank: each compressed gradient matrix n x m is sent as
    (n + m) x rank numbers."""
    powersgd_start_step: int = 10
    """Plain all-reduce before this step, PowerSGD from it (at least 2 with error feedback or
    warm start: DDP rebuilds its buckets after the first step)."""
    powersgd_error_feedback: bool = True
    """Add what compression left out of a step's gradients to the next step's."""
    powersgd_warm_start: bool = True
    """Start each step's power iteration from the last step's factors."""
    steps: int = 20
    """Optimizer steps."""
    batch_size: int = 8
    """Blocks per worker per micro-step: one step trains on workers x hosts x batch_size x
    grad_accum_steps blocks (the global batch)."""
    block_size: int = 64
    """Tokens per training sequence."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step; gradients are synchronised on the last one only."""
    optimizer: str = "adamw"
    """The step's optimizer (DiLoCo's inner optimizer): adamw, or sgd (no momentum)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = off."""
    mixed_precision: str = "auto"
    """auto: bf16 autocast on CUDA devices that have bf16 (fp32 weights), none elsewhere."""
    lora: bool = False
    """Train only PEFT LoRA adapters (the `lora` section), not every weight."""
    max_train_blocks: int = 2048
    """Training sequences taken from the stdlib corpus (its training split)."""
    eval_every: int = 10
    """Validation loss (held-out stdlib text) every this many steps and at the end; 0 = never."""
    eval_blocks: int = 16
    """Validation sequences of block_size tokens."""
    baseline: bool = True
    """A local run with several workers then trains one process on the same global batch
    for the same steps (so the same tokens), and sets its tokens/s and losses beside the run's:
    what the workers bought, and (DiLoCo, top-k, PowerSGD) where the loss stands against
    DDP's, which one process equals. false: skip it (half the time)."""
    target_val_loss: float = 0.0
    """End the run at the first evaluation whose validation loss is at or below this (a
    checkpoint is written there); 0 = train all dp.steps (bench/low_comm_bench.py times it)."""
    checkpoint_every: int = 10
    """Save a torch.distributed.checkpoint every this many steps, and at the end (0 = at the
    end only)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; default `<run dir>/checkpoints`. Across hosts it must be one
    folder every host sees (a shared file system): each worker writes its own part."""
    resume: bool = False
    """Continue from the latest checkpoint in checkpoint_dir (same data order: the losses of an
    uninterrupted run), with any number of workers."""
    init_from: str = ""
    """A warm start: a checkpoint folder (a run's `checkpoints`, or one `step-N` in it) whose
    model weights this run starts from, at step 0 with fresh optimizers, its data going on
    where the warm start's stopped (any dp.sync: only the weights are read). "" = the model as
    loaded."""
    nnodes: str = "1"
    """role=worker: the hosts (agents) in the job, N or MIN:MAX (`2:3`: starts with 2, a third
    joins at the next restart). A local run is one host."""
    max_restarts: int = 3
    """Times the elastic agent restarts the workers (from the last checkpoint) after a failure."""
    join_timeout_s: int = 60
    """Seconds for the rendezvous at cluster.master to be reached and filled; then it fails."""
    last_call_s: int = 30
    """With dp.nnodes=MIN:MAX: once MIN hosts are in, seconds the rendezvous waits for more
    before the job starts (torch's last_call_timeout); later hosts join at the next restart."""

    def __post_init__(self) -> None:
        check_fields_positive(
            "dp", self, ("workers", "steps", "batch_size", "grad_accum_steps", "lr", "eval_blocks")
        )
        check_fields_positive("dp", self, ("max_train_blocks", "join_timeout_s", "last_call_s"))
        check_choice("dp.engine", self.engine, ENGINES)
        check_choice("dp.sync", self.sync, tuple(SyncMethod.registry))
        check_choice("dp.optimizer", self.optimizer, OPTIMIZERS)
        check_choice("dp.pseudo_grad_dtype", self.pseudo_grad_dtype, PSEUDO_GRAD_DTYPES)
        check_choice("dp.balance", self.balance, BALANCES)
        check_fields_positive("dp", self, ("inner_steps", "outer_lr", "bucket_cap_mb"))
        check_positive("dp.outer_momentum", self.outer_momentum, allow_zero=True)
        self._check_streaming()
        if self.outer_momentum >= 1:
            raise ValueError(f"dp.outer_momentum={self.outer_momentum} must be below 1")
        slow = parse_slow_worker(self.slow_worker)
        workers = self.workers * self.node_bounds[1]
        if slow is not None and slow[0] >= workers:
            raise ValueError(
                f"dp.slow_worker={self.slow_worker} names worker {slow[0]}, and the job has "
                f"{workers} (dp.workers={self.workers} x dp.nnodes={self.nnodes}: ranks "
                f"0..{workers - 1})"
            )
        if self.target_val_loss > 0 and not self.eval_every:
            raise ValueError(
                f"dp.target_val_loss={self.target_val_loss} needs evaluations: set dp.eval_every"
            )
        check_fields_positive("dp", self, ("powersgd_rank", "powersgd_start_step"))
        if not 0 < self.topk_fraction <= 1:
            raise ValueError(f"dp.topk_fraction={self.topk_fraction} must be in (0, 1]")
        if self.powersgd_start_step < 2 and (
            self.powersgd_error_feedback or self.powersgd_warm_start
        ):
            raise ValueError(
                f"dp.powersgd_start_step={self.powersgd_start_step} must be >= 2 with error "
                "feedback or warm start (DDP rebuilds its buckets after the first step)"
            )
        if self.engine not in sync_method(self.sync).engines:
            raise ValueError(
                f"dp.sync={self.sync} is for dp.engine=ddp (DDP's communication hooks; DiLoCo "
                "keeps a whole replica on every worker)"
            )
        if self.balance == "tokens" and self.engine != "ddp":
            raise ValueError(
                "dp.balance=tokens is for dp.engine=ddp: FSDP2's forward gathers each layer "
                "from every worker, so every worker must run as many micro-steps as the others"
            )
        check_choice("dp.mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        if self.block_size < 2:
            raise ValueError(f"dp.block_size={self.block_size} must be >= 2")
        for name in ("weight_decay", "grad_clip", "eval_every", "checkpoint_every", "max_restarts",
                     "target_val_loss"):  # fmt: skip
            check_positive(f"dp.{name}", getattr(self, name), allow_zero=True)
        parse_nnodes(self.nnodes)

    def _check_streaming(self) -> None:
        """dp.fragments, dp.overlap_steps, dp.overlap_mix: in range, and with DiLoCo only."""
        check_fields_positive("dp", self, ("fragments",))
        check_positive("dp.overlap_steps", self.overlap_steps, allow_zero=True)
        if not 0 <= self.overlap_mix <= 1:
            raise ValueError(f"dp.overlap_mix={self.overlap_mix} must be in [0, 1]")
        streaming = self.fragments > 1 or self.overlap_steps > 0
        if streaming and not sync_method(self.sync).apart:
            raise ValueError(
                "dp.fragments and dp.overlap_steps are for dp.sync=diloco "
                f"(got dp.sync={self.sync})"
            )
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"dp.fragments={self.fragments} must be at most dp.inner_steps={self.inner_steps} "
                "(each fragment syncs at a step of its own)"
            )
        if self.overlap_steps >= self.inner_steps:
            raise ValueError(
                f"dp.overlap_steps={self.overlap_steps} must be below dp.inner_steps="
                f"{self.inner_steps} (a fragment's sync lands before its next one starts)"
            )
        if streaming and self.balance == "tokens":
            raise ValueError(
                "dp.balance=tokens needs rounds the workers end together: use it with "
                "dp.fragments=1 and dp.overlap_steps=0"
            )

    @property
    def node_bounds(self) -> tuple[int, int]:
        """(min, max) hosts of `nnodes`."""
        return parse_nnodes(self.nnodes)


@dataclass
class DataParallelRunConfig(LabConfig):
    """Schema of `conf/data_parallel.yaml`."""

    dp: DPConfig = field(default_factory=DPConfig)
    lora: LoRASettings = field(default_factory=LoRASettings)
