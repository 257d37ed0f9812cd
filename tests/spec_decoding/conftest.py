"""Tiny random-init target/draft pairs and an in-process verifier server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lab.pretrain import TinyModelSpec, build_llama
from netproto import Connection, Server
from spec_decoding.drafter import Drafter
from spec_decoding.gamma import GammaController
from spec_decoding.verifier import Verifier


@pytest.fixture(scope="session")
def tokenizer(tiny_models: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models / "tiny_target")


def random_llama(tokenizer, *, layers: int, hidden: int, seed: int):
    torch.manual_seed(seed)
    spec = TinyModelSpec(
        num_layers=layers, hidden_size=hidden, num_heads=2, intermediate_size=2 * hidden
    )
    return build_llama(
        spec, vocab_size=len(tokenizer), context_length=256, tokenizer=tokenizer
    ).eval()


@pytest.fixture(scope="session")
def target(tokenizer):
    return random_llama(tokenizer, layers=2, hidden=64, seed=0)


@pytest.fixture(scope="session")
def drafts(tokenizer, target):
    """Drafts that agree with the target never, always, and sometimes."""
    import copy

    unrelated = random_llama(tokenizer, layers=1, hidden=32, seed=1)
    noisy = copy.deepcopy(target)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(0.5 * param.std() * torch.randn_like(param))
    return {"unrelated": unrelated, "same": target, "noisy": noisy}


@pytest.fixture
def verifier(target, tokenizer) -> Verifier:
    return Verifier(target, tokenizer)


@pytest.fixture
def verifier_server(verifier) -> Iterator[Server]:
    server = Server(verifier.handle, name="verifier").start()
    server.verifier = verifier  # type: ignore[attr-defined]
    yield server
    server.stop()


@pytest.fixture
def make_drafter(verifier_server, tokenizer) -> Iterator[Callable[..., Drafter]]:
    conns: list[Connection] = []

    def _make(
        model,
        *,
        gamma: int | None = 3,
        temperature: float = 0.0,
        top_p: float = 1.0,
        pipeline: bool = False,
        draft_top_k: int = 0,
        decode_alone: bool = True,
        branch_depth: int = 0,
        branch_width: int = 1,
        branch_flatness: float = 0.0,
    ) -> Drafter:
        conn = Connection.connect(*verifier_server.address)
        conns.append(conn)
        return Drafter(
            model,
            tokenizer,
            conn,
            gamma=GammaController(fixed=gamma, max_gamma=8),
            temperature=temperature,
            top_p=top_p,
            pipeline=pipeline,
            draft_top_k=draft_top_k,
            decode_alone=decode_alone,
            branch_depth=branch_depth,
            branch_width=branch_width,
            branch_flatness=branch_flatness,
        )

    yield _make
    for conn in conns:
        conn.close()
