"""The maths of speculative decoding as pure functions: no models, no sockets.

Greedy: accept drafted tokens while they equal the target's argmax; the first mismatch is
replaced by the target's choice, and if all match the target adds one more (the bonus).
Sampling in rounds (Leviathan et al. 2023; Chen et al. 2023): accept draft token x with
probability min(1, p(x) / q(x)); at the first rejection sample from normalize(max(0, p - q));
if all are accepted, sample the bonus from p. Pipelined sampling couples the two models by a
noise per position instead (`coupled_token`). Either way the output is distributed exactly as
the target's own.
"""

from __future__ import annotations

import hashlib
import struct

import torch


def greedy_verdict(target_logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """(accepted, next token) for greedy decoding.

    `target_logits`: (k + 1, V), row i is the target's prediction after draft[:i]; if all k
    match, the last row gives the next token (the bonus).
    """
    choices = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def speculative_verdict(
    p: torch.Tensor, q: torch.Tensor, draft: list[int], *, generator: torch.Generator
) -> tuple[int, int]:
    """(accepted, next token) under the speculative sampling rule.

    `p`: (k + 1, V) target probabilities; `q`: (k, V) draft probabilities the draft tokens were
    sampled from. A draft accepted whole gets the bonus token, sampled from p's last row.
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
    return k, int(torch.multinomial(p[k], 1, generator=generator).item())


def position_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise for the token at `position` of a session seeded `seed`: (V,) float64.

    Both sides draw it alike (a CPU generator seeded from the pair; bit for bit the same on any
    machine), so which token a position gets depends on the seed and the prefix only, never on
    who decided it or when: the drafter's guess, the verifier's check and the verifier's own
    decoding all read the same noise."""
    mixed = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(mixed, "little") >> 1)
    uniform = torch.rand(vocab_size, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniform))


def coupled_token(probs: torch.Tensor, noise: torch.Tensor) -> int:
    """The Gumbel-max draw from `probs` (V,) with `noise` (position_noise): distributed exactly
    as `probs` over seeds, a function of (seed, position, probs) for one seed.

    Pipelined sampling (Daliri et al. 2024, drafter-invariant speculative decoding): the
    verifier's token at a position is its own Gumbel-max draw from p; the drafter guesses it
    with the same noise on q, and a guess is accepted when it equals that draw. The output is
    the target's law whatever the draft, and a seed gives the same text whether a token was
    checked against a guess or decoded by the verifier alone. A guess matches with probability
    at least (1 - d) / (1 + d) for total variation d, where the rule above accepts 1 - d."""
    return int((probs.double().log() + noise).argmax())
