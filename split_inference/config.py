"""split_inference's config schema (`conf/split_inference.yaml`); the `split` section is the
split engine's (`split_engine.config.SplitConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.config import LabConfig, check_fields_positive
from lab.serving import ServeConfig
from split_engine.config import SplitConfig


@dataclass
class GenerateConfig:
    """What the driver generates and measures."""

    num_prompts: int = 4
    """Prompts from the held-out stdlib corpus (the start of validation files)."""
    prompt_tokens: int = 32
    """Longest prompt; in a batch, prompts are cut to different lengths and left-padded."""
    batch_size: int = 2
    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy (identical to the unsplit model's greedy decoding); > 0: sampling."""
    top_p: float = 1.0
    kv_cache: bool = True
    """Keep a KV cache in every stage (prefill once, then one token per step); false
    recomputes the whole prefix every step (the baseline the cache is measured against)."""
    baseline: bool = True
    """Also run the unsplit model in the driver on the same prompts (needs it to fit there)."""
    seed: int = 0
    clients: int = 0
    """After the timed runs, serve 1, 2, 4, ... up to this many concurrent greedy requests
    through the stages (`split.micro_batches` in flight; split_inference/load.py) and log their
    throughput and latency per client count (`serve_*`); 0: off."""

    def __post_init__(self) -> None:
        check_fields_positive(
            "generate", self, ("num_prompts", "prompt_tokens", "batch_size", "max_new_tokens")
        )
        if not 0 <= self.clients <= 64:
            raise ValueError(f"generate.clients={self.clients} must be in 0..64 (0: off)")
        if self.temperature < 0:
            raise ValueError(f"generate.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generate.top_p={self.top_p} must be in (0, 1]")


@dataclass
class ServingSplitConfig(SplitConfig):
    """The split engine's config, and how `role=serve` keeps several requests in flight."""

    max_concurrent: int = 8
    """role=serve: requests generating at once, each with its own KV-cache slot on every stage;
    a request over the bound waits (and says so) for serve.queue_timeout_s."""
    micro_batches: int = 0
    """role=serve: micro-batches moving down the stages at once (each stage computes one while
    the next computes another); the calls in flight per stage are bounded by it. 0: one per
    stage (num_stages); 1: one micro-batch of every active request at a time (batching only)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields_positive("split", self, ("max_concurrent",))
        if self.micro_batches < 0:
            raise ValueError(f"split.micro_batches={self.micro_batches} must be >= 0 (0: auto)")

    @property
    def in_flight(self) -> int:
        return self.micro_batches or self.num_stages


@dataclass
class SplitInferenceRunConfig(LabConfig):
    """Schema of `conf/split_inference.yaml`."""

    split: ServingSplitConfig = field(default_factory=ServingSplitConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    """`role=serve`: the OpenAI-compatible endpoint (docs/serving.md)."""
