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

    def __post_init__(self) -> None:
        check_fields_positive(
            "generate", self, ("num_prompts", "prompt_tokens", "batch_size", "max_new_tokens")
        )
        if self.temperature < 0:
            raise ValueError(f"generate.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generate.top_p={self.top_p} must be in (0, 1]")


@dataclass
class SplitInferenceRunConfig(LabConfig):
    """Schema of `conf/split_inference.yaml`."""

    split: SplitConfig = field(default_factory=SplitConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    """`role=serve`: the OpenAI-compatible endpoint (docs/serving.md)."""
