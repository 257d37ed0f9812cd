"""A causal LM with a KV cache that follows a committed token sequence and rolls back.

Both sides of speculative decoding run forwards over tokens that may later be rejected. Instead
of recomputing the prefix, the cache is cropped to the longest prefix that is still committed.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache


class BatchedForwards(Protocol):
    """Runs a decoder's forward in one batch with other sessions' (spec_decoding.batching's
    BatchedTarget; named here as a protocol so this module imports nothing above it)."""

    def run(self, decoder: CachedDecoder, feed: list[int]) -> torch.Tensor: ...


class CachedDecoder:
    """Feeds a model only what its cache lacks; `commit` rolls the cache back past rejections."""

    def __init__(
        self, model: torch.nn.Module, prompt: list[int], *, batched: BatchedForwards | None = None
    ) -> None:
        """`batched`: run forwards through it, in one batch with other sessions' (the
        verifier's); None: alone (the drafter's)."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        self.model = model
        self.batched = batched
        self.device = next(model.parameters()).device
        self.tokens: list[int] = list(prompt)
        """The committed sequence: prompt + generated tokens."""
        self.cache = DynamicCache()
        self.cached: list[int] = []
        """The tokens whose keys/values the cache holds, in order."""

    def extend(self, speculative: list[int]) -> torch.Tensor:
        """Run the committed tokens the cache lacks, then `speculative`; return their logits.

        Returns (fed, V) float logits: row i predicts the token after the i-th token fed. The
        last row is the prediction after the last of `speculative` (or of the committed tokens).
        """
        base = self.tokens if len(self.cached) < len(self.tokens) else self.cached
        feed = base[len(self.cached) :] + list(speculative)
        if not feed:
            raise ValueError("nothing to feed: the cache already covers every token")
        return self._run(feed)

    def prefill(self) -> None:
        """Cache the prompt, all but its last token (which the first step feeds)."""
        if len(self.tokens) > 1 and not self.cached:
            # alone, in the caller's thread: a long prompt holds up no other session's check
            self._run(self.tokens[:-1], alone=True)

    @torch.inference_mode()  # cheaper than no_grad per call: decoding never needs autograd
    def _run(self, feed: list[int], *, alone: bool = False) -> torch.Tensor:
        if self.batched is not None and not alone:
            logits = self.batched.run(self, feed)  # (fed, V); our cache has grown by `feed`
            self.cached.extend(feed)
            return logits
        input_ids = torch.tensor([feed], dtype=torch.long, device=self.device)  # (1, fed)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.cached.extend(feed)
        return out.logits[0].float()  # (fed, V)

    def commit(self, tokens: list[int], *, cache_last: bool = False) -> None:
        """Append `tokens` to the committed sequence and drop cache entries that disagree."""
        self.rewind([*self.tokens, *tokens], cache_last=cache_last)

    def rewind(self, sequence: list[int], *, cache_last: bool = False) -> None:
        """Make `sequence` the committed one, keeping the cache of its longest common prefix.

        The cache never keeps the last committed token unless `cache_last`, so the next
        `extend` has one to feed and returns the prediction after it. With `cache_last` (the
        caller already holds that prediction) the cache may cover the whole sequence.
        """
        if not sequence:
            raise ValueError("the committed sequence must hold at least one token")
        self.tokens = list(sequence)
        valid = 0
        limit = min(len(self.cached), len(self.tokens) - (0 if cache_last else 1))
        while valid < limit and self.cached[valid] == self.tokens[valid]:
            valid += 1
        if valid < len(self.cached):
            self.cache.crop(valid - len(self.cached))  # transformers 5: minus tokens to drop
            del self.cached[valid:]
