"""Batched generation with a KV cache, timed token by token: the same loop for the sharded model
on every rank and for the unsplit baseline.

Prompts are left-padded into one batch (attention mask, positions from it). Greedy takes the
arg-max; sampling draws from `lab.sampling`'s distribution with a generator seeded alike on
every rank (rank 0's seed, broadcast before the run): the logits are the same on every rank
(the all-reduce hands each rank the same sums, the head is whole on each), so every rank draws
the same token, and `same_on_every_rank` checks it once at the end.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lab.sampling import probs_from_logits


@dataclass
class Generation:
    """What one batched generation produced and how long each token took."""

    tokens: torch.Tensor
    """(B, new) generated token ids."""
    token_s: list[float]
    """Seconds per decode step (the prefill's first token is `prefill_s`)."""
    prefill_s: float
    step_logits: list[torch.Tensor] = field(default_factory=list)
    """(B, V) logits of every step, kept when asked (the exactness tests)."""
    token_cpu_s: list[float] = field(default_factory=list)
    """CPU seconds the calling thread spent per decode step (a step's wall time less what it
    waited: in collectives, or for a core other work held)."""

    def ms(self, q: float) -> float:
        """The q-quantile of a decode step (ms)."""
        if not self.token_s:
            return float("nan")
        ordered = sorted(self.token_s)
        return 1e3 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    @property
    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.token_s) if self.token_s else float("nan")


def left_padded(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids left-padded with `pad_id`, and their (B, T) attention mask."""
    width = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    keep_logits: bool = False,
    sync: Callable[[], None] = lambda: None,
    after_prefill: Callable[[], None] = lambda: None,
) -> Generation:
    """`max_new_tokens` tokens for each prompt of the (B, T) batch; temperature 0 is greedy.
    `sync` runs before each step's clock stops (a CUDA synchronize); `after_prefill` once the
    prompt's step is done (counters of the decode steps alone start there)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    cache = DynamicCache(config=model.config)  # type: ignore[arg-type]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    step_input, out, times, kept, cpu = ids, [], [], [], []
    prefill_s = 0.0
    for step in range(max_new_tokens):
        started, cpu_started = time.perf_counter(), time.thread_time()
        logits = model(
            input_ids=step_input,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1, :]  # (B, V)
        if temperature > 0:
            probs = probs_from_logits(logits.cpu(), temperature=temperature, top_p=top_p)
            token = torch.multinomial(probs, 1, generator=generator).to(device)  # (B, 1)
        else:
            token = logits.argmax(-1, keepdim=True)  # (B, 1)
        sync()
        elapsed = time.perf_counter() - started
        if step == 0:
            prefill_s = elapsed
            after_prefill()
        else:
            times.append(elapsed)
            cpu.append(time.thread_time() - cpu_started)
        if keep_logits:
            kept.append(logits.detach().cpu())
        out.append(token)
        step_input = token
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)  # (B, T + step + 1)
        positions = positions[:, -1:] + 1  # (B, 1)
    return Generation(torch.cat(out, dim=-1).cpu(), times, prefill_s, kept, cpu)


def same_on_every_rank(tokens: torch.Tensor, group: Any = None) -> bool:
    """Whether every rank generated `tokens` (one all-gather, after the run)."""
    gathered = [torch.empty_like(tokens) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tokens.contiguous(), group=group)
    return all(torch.equal(g, tokens) for g in gathered)
