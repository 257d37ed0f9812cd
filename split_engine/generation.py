"""The decode loop shared by the split model and the unsplit baseline it is measured against.

`decode` asks `model.next_token(feed, attention_mask, position_ids, request=...)` once per step
for the next token of every row; the model picks it from its logits with the request's
`TokenPicker` (greedy, or seeded sampling). `UnsplitModel` does that in this process; on a split
model the loop runs in the first stage's process and the last stage picks (`Stage.decode`), so a
token crosses no driver and no logits cross the wire. Same loop, same positions, same picker:
any difference in output or time is the split.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from lab.sampling import probs_from_logits


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy (temperature 0) or sampled with a seeded stream."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain values, as RPC messages carry them."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Sampling:
        temperature, top_p, seed = values["temperature"], values["top_p"], values["seed"]
        if not (isinstance(temperature, float | int) and temperature >= 0):
            raise ValueError(f"temperature={temperature!r} must be a number >= 0")
        if not (isinstance(top_p, float | int) and 0 < top_p <= 1):
            raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
        if type(seed) is not int:
            raise ValueError(f"seed={seed!r} must be an int")
        return cls(float(temperature), float(top_p), seed)


class TokenPicker:
    """A request's next tokens from its last-position logits: argmax, or one draw per row from a
    generator seeded once per request (the same draws wherever the picker runs)."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.generator = (
            torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
        )

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B,) token ids."""
        if self.generator is None:
            return logits.argmax(dim=-1)
        probs = probs_from_logits(
            logits.float().cpu(), temperature=self.sampling.temperature, top_p=self.sampling.top_p
        )
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of left-padded rows, as Hugging Face `generate` computes them."""
    positions = attention_mask.long().cumsum(-1) - 1  # (B, T)
    return positions.masked_fill(attention_mask == 0, 1)


class StepModel(Protocol):
    def next_token(
        self,
        feed: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        request: int,
    ) -> torch.Tensor:
        """(B,) the next token of each row, picked by the request's picker."""
        ...

    def new_request(self, sampling: Sampling, *, kv_cache: bool) -> int: ...

    def end_request(self, request: int) -> None: ...


@dataclass
class Generation:
    tokens: torch.Tensor
    """(B, new) generated ids; rows that stopped early are padded with pad_token_id."""
    prefill_s: float
    step_s: list[float] = field(default_factory=list)
    """Seconds per decode step after the prefill."""

    def as_dict(self) -> dict[str, Any]:
        """Plain values and a tensor, as RPC replies carry them."""
        return {"tokens": self.tokens, "prefill_s": self.prefill_s, "step_s": list(self.step_s)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Generation:
        return cls(
            values["tokens"], float(values["prefill_s"]), [float(s) for s in values["step_s"]]
        )


@torch.no_grad()
def decode(
    model: StepModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    kv_cache: bool = True,
    on_token: Callable[[torch.Tensor], None] | None = None,
) -> Generation:
    """Greedy (temperature 0) or sampled continuation of left-padded prompts (B, T).

    With `kv_cache` the prompt is run once and then only each new token; without, the whole
    sequence is recomputed every step (what a model without a cache has to do). `on_token`
    sees each step's tokens (B,) as they come; what it raises ends the generation (the
    request's state freed on every stage) and propagates.
    """
    batch = input_ids.shape[0]
    request = model.new_request(sampling, kv_cache=kv_cache)
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
            token = model.next_token(feed, mask, positions, request=request)  # (B,)
            token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
            generated.append(token)
            if on_token is not None:
                on_token(token)
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
        model.end_request(request)
    return Generation(torch.stack(generated, dim=1), prefill_s, step_s)


class UnsplitModel:
    """A whole Hugging Face causal LM in this process, behind the same interface as the split
    one."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches: dict[int, Any] = {}
        self.pickers: dict[int, TokenPicker] = {}
        self._next = 0

    def next_token(
        self,
        feed: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        request: int,
    ) -> torch.Tensor:
        device = self.model.device
        cached = request in self.caches
        out = self.model(
            input_ids=feed.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=self.caches[request] if cached else None,
            use_cache=cached,
            logits_to_keep=1,
        )
        if cached:
            self.caches[request] = out.past_key_values
        return self.pickers[request](out.logits[:, -1]).cpu()  # (B,)

    def new_request(self, sampling: Sampling, *, kv_cache: bool) -> int:
        from transformers import DynamicCache

        self._next += 1
        self.pickers[self._next] = TokenPicker(sampling)
        if kv_cache:
            self.caches[self._next] = DynamicCache()
        return self._next

    def end_request(self, request: int) -> None:
        self.caches.pop(request, None)
        self.pickers.pop(request, None)
