"""`python -m split_inference role=serve`: the split model behind an OpenAI-compatible endpoint.

This process is the driver (rank 0: the stages join it as they do a `role=driver` run); it
cuts the model across the stages, then answers `/v1/completions` and `/v1/chat/completions`
(`lab.serving`) with up to `split.max_concurrent` requests in flight through the stages
(`split_engine.batching.Pipeline`: continuous batching, `split.micro_batches` micro-batches
moving at once), each token handed to its request's stream as it comes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lab.models import load_tokenizer, resolve_source
from lab.openai_http import serve
from lab.serving import Params
from split_engine.batching import Pipeline
from split_engine.generation import Sampling, decode
from split_engine.roles import driving
from split_engine.sharded import DriverChain, ShardedModel
from split_inference.config import SplitInferenceRunConfig

log = logging.getLogger(__name__)


class SplitEngine:
    """`lab.serving.Engine` over the split model: several requests in flight through the stages
    (a `Pipeline`), or with `kv_cache=False` one at a time, each recomputing its prefix."""

    def __init__(
        self,
        sharded: ShardedModel,
        tokenizer: Any,
        *,
        kv_cache: bool,
        max_concurrent: int = 1,
        in_flight: int = 1,
    ) -> None:
        self.sharded, self.chain = sharded, DriverChain(sharded)
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
        self.kv_cache = kv_cache
        self.context_tokens: int | None = None
        self.pipeline: Pipeline | None = None
        self.max_concurrent = 1
        self.slots_key = "split.max_concurrent=1"
        if kv_cache:
            self.pipeline = Pipeline(
                sharded,
                max_concurrent=max_concurrent,
                in_flight=in_flight,
                eos_token_id=self.eos,
            )
            self.max_concurrent = max_concurrent
            self.slots_key = f"split.max_concurrent={max_concurrent}"

    def generate(self, prompt: list[int], params: Params, on_tokens: Any) -> list[int]:
        tokens: list[int] = []
        sampling = Sampling(params.temperature, params.top_p, seed=params.seed)
        if self.pipeline is not None:

            def on_one(token: int) -> None:
                tokens.append(token)
                on_tokens(tokens)

            return self.pipeline.generate(
                prompt, sampling, max_new_tokens=params.max_new_tokens, on_token=on_one
            )

        def on_token(step: torch.Tensor) -> None:  # (1,)
            tokens.append(int(step[0]))
            on_tokens(tokens)

        ids = torch.tensor([prompt], dtype=torch.long)  # (1, T)
        generation = decode(
            self.chain,
            ids,
            torch.ones_like(ids),
            max_new_tokens=params.max_new_tokens,
            sampling=sampling,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            kv_cache=self.kv_cache,
            on_token=on_token,
        )
        return [int(t) for t in generation.tokens[0]]

    def health(self) -> dict[str, Any]:
        """Requests each stage holds state for (KV cache, picker): 0 between requests."""
        stats = self.sharded.call_all("stats")
        health: dict[str, Any] = {"open_requests": [int(s["open_requests"]) for s in stats]}
        if self.pipeline is not None:
            health["pipeline"] = self.pipeline.stats()
        return health

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


def context_tokens(settings: SplitInferenceRunConfig) -> int | None:
    """The model's context (config.json's max_position_embeddings), where it says."""
    from transformers import AutoConfig

    source = resolve_source(settings.model, cache_dir=settings.paths.cache_path)
    config = AutoConfig.from_pretrained(source, trust_remote_code=settings.model.trust_remote_code)
    context = getattr(config, "max_position_embeddings", None)
    return context if isinstance(context, int) and context > 0 else None


def serve_role(settings: SplitInferenceRunConfig) -> dict[str, float]:
    """`role=serve`: drive the stages and serve the endpoint until SIGINT or SIGTERM."""
    tokenizer = load_tokenizer(settings.model, cache_dir=settings.paths.cache_path)
    with driving(settings, settings.split):
        sharded = ShardedModel.build(settings.model, settings.split)
        split = settings.split
        if not settings.generate.kv_cache and split.max_concurrent > 1:
            log.warning(
                "generate.kv_cache=false: requests are served one at a time (each recomputes "
                "its prefix), not split.max_concurrent=%d at once",
                split.max_concurrent,
            )
        engine = SplitEngine(
            sharded,
            tokenizer,
            kv_cache=settings.generate.kv_cache,
            max_concurrent=split.max_concurrent,
            in_flight=split.in_flight,
        )
        engine.context_tokens = context_tokens(settings)
        try:
            serve(
                engine,
                tokenizer,
                model_id=settings.serve.model_id or settings.model.name,
                config=settings.serve,
                secret=settings.cluster.resolved_secret(),
            )
        finally:
            engine.close()
    return {}
