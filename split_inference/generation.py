"""The decode loop shared by the split model and the unsplit baseline it is measured against.

`decode` calls `model.step(feed, attention_mask, position_ids, request=...)` once per token; the
split model (`ShardedModel`) runs that step across its stages, `UnsplitModel` runs it in this
process. Same loop, same positions, same sampling: any difference in output or time is the split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lab.sampling import probs_from_logits


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as Hugging Face `generate` computes them."""
    positions = attention_mask.long().cumsum(-1) - 1  # (B, T)
    return positions.masked_fill(attention_mask == 0, 1)


class StepModel(Protocol):
    def step(
        self,
        feed: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        request: int | None,
    ) -> torch.Tensor: ...

    def new_request(self) -> int: ...

    def end_request(self, request: int) -> None: ...


@dataclass
class Generation:
    tokens: torch.Tensor
    """(B, new) generated ids; rows that stopped early are padded with pad_token_id."""
    prefill_s: float
    step_s: list[float] = field(default_factory=list)
    """Seconds per decode step after the prefill."""


@torch.no_grad()
def decode(
    model: StepModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    generator: torch.Generator | None = None,
    kv_cache: bool = True,
) -> Generation:
    """Greedy (temperature 0) or sampled continuation of left-padded prompts (B, T).

    With `kv_cache` the prompt is run once and then only each new token; without, the whole
    sequence is recomputed every step (what a model without a cache has to do).
    """
    batch = input_ids.shape[0]
    request = model.new_request() if kv_cache else None
    unfinished = torch.ones(batch, dtype=torch.bool)
    generated: list[torch.Tensor] = []
    step_s: list[float] = []
    ids, mask = input_ids, attention_mask
    feed = ids  # what enters the first stage this step
    prefill_s = 0.0
    try:
        for step in range(max_new_tokens):
            started = time.perf_counter()
            positions = positions_from_mask(mask)  # (B, T_total)
            if kv_cache and step > 0:
                positions = positions[:, -1:]  # (B, 1): only the new token
            next_logits = model.step(feed, mask, positions, request=request)[:, -1]  # (B, V)
            if temperature == 0:
                token = next_logits.argmax(dim=-1)  # (B,)
            else:
                probs = probs_from_logits(next_logits, temperature=temperature, top_p=top_p)
                token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
            generated.append(token)
            if eos_token_id is not None:
                unfinished &= token != eos_token_id
            ids = torch.cat([ids, token[:, None]], dim=-1)  # (B, T+1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)  # (B, T+1)
            feed = token[:, None] if kv_cache else ids
            elapsed = time.perf_counter() - started
            if step == 0:
                prefill_s = elapsed
            else:
                step_s.append(elapsed)
            if not unfinished.any():
                break
    finally:
        if request is not None:
            model.end_request(request)
    return Generation(torch.stack(generated, dim=1), prefill_s, step_s)


class UnsplitModel:
    """A whole Hugging Face causal LM in this process, behind the same `step` as the split one."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches: dict[int, Any] = {}
        self._next = 0

    def step(
        self,
        feed: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        request: int | None,
    ) -> torch.Tensor:
        device = self.model.device
        out = self.model(
            input_ids=feed.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=self.caches.get(request) if request is not None else None,
            use_cache=request is not None,
            logits_to_keep=1,
        )
        if request is not None:
            self.caches[request] = out.past_key_values
        return out.logits.float().cpu()  # (B, 1, V)

    def new_request(self) -> int:
        self._next += 1
        return self._next

    def end_request(self, request: int) -> None:
        self.caches.pop(request, None)
