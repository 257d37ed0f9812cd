"""split_training's config schema (`conf/split_training.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.config import LabConfig, LoRASettings, check_choice, check_fields_positive
from split_engine.config import SplitConfig

MIXED_PRECISIONS = ("auto", "bf16", "none")
SCHEDULES = ("gpipe", "1f1b")


@dataclass
class SplitTrainConfig(SplitConfig):
    """The cut (as in split_inference) plus how the split model is trained."""

    microbatches: int = 4
    """Micro-batches per batch, flowing through the stages concurrently (GPipe fill-drain);
    1 = no pipelining. Gradients of all of them make one optimizer step."""
    schedule: str = "gpipe"
    """The order each stage runs its micro-batches in: gpipe (every forward, then every
    backward: the most micro-batches in flight, the fewest waits on a slow link) or 1f1b (one
    forward, one backward in the steady state: stage k holds at most num_stages - k
    micro-batches' activations, but waits a round trip to the next stage for each backward).
    Both give the same gradients."""
    steps: int = 40
    """Optimizer steps."""
    batch_size: int = 8
    block_size: int = 64
    """Tokens per training sequence."""
    grad_accum_steps: int = 1
    """Batches per optimizer step (each with its own backward, so activations of one batch at
    a time are alive)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip the global gradient norm (over every stage) to this; 0 = off."""
    mixed_precision: str = "auto"
    """auto: bf16 autocast on CUDA devices that have bf16, none elsewhere; bf16 forces it."""
    lora: bool = False
    """Train only PEFT LoRA adapters (the `lora` section) on every stage, not all weights."""
    max_train_blocks: int = 4096
    """Training sequences taken from the stdlib corpus (its training split)."""
    eval_every: int = 10
    """Validation loss (held-out stdlib text, forward only) every this many steps and at the
    end; 0 = never."""
    eval_blocks: int = 16
    """Validation sequences of block_size tokens."""
    checkpoint_every: int = 20
    """Save every stage's weights and optimizer state every this many steps (0 = at the end
    only)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; default `<run dir>/checkpoints`. Each stage writes its own files
    under this path on its own host."""
    export: bool = False
    """At the end, write the whole trained model as one Hugging Face folder, `<run dir>/model`
    (`from_pretrained` loads it; a tied embedding / LM head is saved once and loads tied).
    Not with `lora=true`."""
    resume: bool = False
    """Continue from the latest checkpoint in checkpoint_dir (same data order: the losses are
    those of an uninterrupted run)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields_positive(
            "split", self, ("microbatches", "steps", "batch_size", "grad_accum_steps", "lr")
        )
        if self.block_size < 2:
            raise ValueError(f"split.block_size={self.block_size} must be >= 2")
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"split.batch_size={self.batch_size} must be a multiple of "
                f"split.microbatches={self.microbatches}"
            )
        if self.weight_decay < 0 or self.grad_clip < 0 or self.checkpoint_every < 0:
            raise ValueError("split.weight_decay, grad_clip and checkpoint_every must be >= 0")
        if self.eval_every < 0 or self.eval_blocks < 1:
            raise ValueError(
                f"split.eval_every={self.eval_every} must be >= 0 and "
                f"split.eval_blocks={self.eval_blocks} >= 1"
            )
        check_choice("split.schedule", self.schedule, SCHEDULES)
        check_choice("split.mixed_precision", self.mixed_precision, MIXED_PRECISIONS)
        if self.export and self.lora:
            raise ValueError(
                "split.export=true writes the whole model; with split.lora=true the run trains "
                "adapters only (its checkpoints hold them): use one or the other"
            )


@dataclass
class SplitTrainingRunConfig(LabConfig):
    """Schema of `conf/split_training.yaml`."""

    split: SplitTrainConfig = field(default_factory=SplitTrainConfig)
    lora: LoRASettings = field(default_factory=LoRASettings)
