"""The drafter: runs the small model next to the user and asks the verifier to check drafts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from netproto import Connection, ConnectionClosed, NetTimeout, PeerProtocolError
from spec_decoding.cache import CachedDecoder
from spec_decoding.gamma import GammaController
from spec_decoding.protocol import SpecMsg
from spec_decoding.sampling import probs_from_logits
from spec_decoding.verifier import vocab_hash


class VerifierLostError(RuntimeError):
    """The verifier went away (or stopped answering) while we needed it."""


@dataclass
class RoundStats:
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    round_s: float


@dataclass
class Generation:
    """One prompt's speculative generation and how it went."""

    tokens: list[int]
    seconds: float
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_ms: float = 0.0


class Drafter:
    """Speculative generation against a remote verifier, one session per `generate` call."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        conn: Connection,
        *,
        gamma: GammaController,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> None:
        self.model = model
        self.conn = conn
        self.gamma = gamma
        self.temperature = temperature
        self.top_p = top_p
        self.eos_token_id = tokenizer.eos_token_id
        self.vocab_hash = vocab_hash(tokenizer)

    def _request(self, msg_type: int, payload: Any, *, expect: int) -> dict[str, Any]:
        try:
            return self.conn.request(msg_type, payload, expect=expect).payload
        except (ConnectionClosed, NetTimeout, PeerProtocolError) as exc:
            raise VerifierLostError(f"lost the verifier at {self.conn.peer}: {exc}") from None

    def _propose(
        self, decoder: CachedDecoder, gamma: int, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """Draft `gamma` tokens autoregressively; with sampling, also their distributions q."""
        draft: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(gamma):
            logits = decoder.extend(draft[-1:])[-1]  # (V,)
            if self.temperature == 0:
                token = int(logits.argmax())
            else:
                q = probs_from_logits(logits, temperature=self.temperature, top_p=self.top_p)
                token = int(torch.multinomial(q, 1, generator=generator).item())
                rows.append(q)
            draft.append(token)
        return draft, (torch.stack(rows) if rows else None)  # q: (gamma, V)

    def generate(self, prompt: list[int], *, max_new_tokens: int, seed: int = 0) -> Generation:
        started = time.perf_counter()
        opened = self._request(
            SpecMsg.OPEN,
            {
                "prompt": prompt,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": seed,
                "vocab_hash": self.vocab_hash,
            },
            expect=SpecMsg.OPENED,
        )
        decoder = CachedDecoder(self.model, prompt)
        decoder.prefill()
        generator = torch.Generator().manual_seed(seed + 1)
        result = Generation(tokens=[], seconds=0.0, prefill_ms=float(opened["prefill_ms"]))
        while len(result.tokens) < max_new_tokens:
            round_started = time.perf_counter()
            gamma = min(self.gamma.next_gamma(), max_new_tokens - len(result.tokens) - 1)
            draft, q = self._propose(decoder, gamma, generator) if gamma > 0 else ([], None)
            drafted_at = time.perf_counter()
            payload = {"tokens": torch.tensor(draft, dtype=torch.int32)}
            if q is not None:
                payload["q"] = q
            verdict = self._request(SpecMsg.DRAFT, payload, expect=SpecMsg.VERDICT)
            accepted, token = int(verdict["accepted"]), int(verdict["token"])
            if not 0 <= accepted <= len(draft):
                raise ValueError(f"verifier accepted {accepted} of {len(draft)} drafted tokens")
            new = [*draft[:accepted], token]
            decoder.commit(new)
            stats = RoundStats(
                drafted=len(draft),
                accepted=accepted,
                draft_s=drafted_at - round_started,
                verify_s=float(verdict["verify_ms"]) / 1e3,
                round_s=time.perf_counter() - round_started,
            )
            result.rounds.append(stats)
            self.gamma.update(
                drafted=stats.drafted,
                accepted=stats.accepted,
                draft_s=stats.draft_s,
                verify_s=stats.verify_s,
                round_s=stats.round_s,
            )
            if self.eos_token_id is not None and self.eos_token_id in new:
                result.tokens.extend(new[: new.index(self.eos_token_id) + 1])
                break
            result.tokens.extend(new)
        self.conn.send(SpecMsg.CLOSE)
        result.tokens = result.tokens[:max_new_tokens]
        result.seconds = time.perf_counter() - started
        return result

    def baseline(self, prompt: list[int], *, max_new_tokens: int, seed: int = 0) -> dict[str, Any]:
        """Target-only generation on the verifier (timed there, no network in the figure)."""
        return self._request(
            SpecMsg.BASELINE,
            {
                "prompt": prompt,
                "max_new_tokens": max_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": seed,
            },
            expect=SpecMsg.BASELINE_DONE,
        )
