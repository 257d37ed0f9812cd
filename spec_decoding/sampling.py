"""The maths of speculative decoding as pure functions: no models, no sockets.

Greedy: accept drafted tokens while they equal the target's argmax; the first mismatch is
replaced by the target's choice, and if all match the target adds one more (the bonus).
Sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft token x with probability
min(1, p(x) / q(x)); at the first rejection sample from normalize(max(0, p - q)); if all are
accepted, sample the bonus from p. The output is distributed exactly as the target's own.
"""

from __future__ import annotations

from typing import overload

import torch


@overload
def greedy_verdict(target_logits: torch.Tensor, draft: list[int]) -> tuple[int, int]: ...
@overload
def greedy_verdict(
    target_logits: torch.Tensor, draft: list[int], *, bonus: bool
) -> tuple[int, int | None]: ...
def greedy_verdict(
    target_logits: torch.Tensor, draft: list[int], *, bonus: bool = True
) -> tuple[int, int | None]:
    """(accepted, next token) for greedy decoding.

    `target_logits`: (k + 1, V), row i is the target's prediction after draft[:i] (k rows
    are enough without `bonus`). Without `bonus`, a draft accepted whole gives no next token:
    the pipelined verifier keeps the last row to check the drafter's next token with.
    """
    choices = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    if accepted == len(draft) and not bonus:
        return accepted, None
    return accepted, choices[accepted]


@overload
def speculative_verdict(
    p: torch.Tensor, q: torch.Tensor, draft: list[int], *, generator: torch.Generator
) -> tuple[int, int]: ...
@overload
def speculative_verdict(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: list[int],
    *,
    generator: torch.Generator,
    bonus: bool,
) -> tuple[int, int | None]: ...
def speculative_verdict(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: list[int],
    *,
    generator: torch.Generator,
    bonus: bool = True,
) -> tuple[int, int | None]:
    """(accepted, next token) under the speculative sampling rule.

    `p`: (k + 1, V) target probabilities; `q`: (k, V) draft probabilities the draft tokens were
    sampled from. Without `bonus`, a draft accepted whole gives (k, None) and draws nothing
    more: checking it in pieces draws the same random numbers as checking it at once.
    """
    for i, token in enumerate(draft):
        ratio = (p[i, token] / q[i, token]).item() if q[i, token] > 0 else float("inf")
        if torch.rand((), generator=generator).item() >= min(1.0, ratio):
            residual = (p[i] - q[i]).clamp_min(0)
            total = residual.sum()
            # p == q in floating point leaves no mass: then p itself is the right law
            law = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(law, 1, generator=generator).item())
    k = len(draft)
    if not bonus:
        return k, None
    return k, int(torch.multinomial(p[k], 1, generator=generator).item())
