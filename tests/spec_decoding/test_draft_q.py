"""q on the wire: integer weights over q's support, so the verifier rebuilds bit for bit the q
the drafter sampled from; every malformed q is refused with its reason."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.sampling import probs_from_logits
from netproto.codecs import encode_frame
from netproto.header import REGISTRY, Limits
from spec_decoding.draft_q import (
    TOTAL,
    BadDraftQ,
    as_probabilities,
    decode_q,
    encode_q,
    from_varints,
    quantize,
    to_varints,
)
from spec_decoding.protocol import SpecMsg

VOCAB = 1000


def nucleus(k: int = 2, vocab: int = VOCAB, *, top_p: float = 0.9, top_k: int = 0, seed: int = 0):
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return probs_from_logits(logits, temperature=0.8, top_p=top_p, top_k=top_k)


def sent(weights: torch.Tensor) -> torch.Tensor:
    """What the verifier rebuilds from the entries the drafter sends."""
    draft = [int(row.argmax()) for row in weights]
    return decode_q(encode_q(weights), draft, weights.size(-1))


def test_the_verifier_rebuilds_bit_for_bit_the_q_the_drafter_samples_from() -> None:
    weights = quantize(nucleus())
    assert (weights.sum(dim=-1) == TOTAL).all()
    assert torch.equal(sent(weights), as_probabilities(weights))


def test_quantizing_moves_each_probability_by_less_than_one_weight() -> None:
    q = nucleus()
    assert ((as_probabilities(quantize(q)) - q).abs() < 1 / TOTAL).all()


def test_a_certain_token_weighs_the_whole_total() -> None:
    q = torch.zeros(1, VOCAB)
    q[0, 7] = 1.0
    assert torch.equal(sent(quantize(q)), q)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 70_000 - 1), min_size=1, max_size=40, unique=True))
def test_any_support_comes_back_at_its_ids(ids: list[int]) -> None:
    """Gaps of any size: one byte below 255, escapes above (a 70k vocabulary)."""
    q = torch.zeros(1, 70_000)
    q[0, ids] = 1.0 / len(ids)
    weights = quantize(q)
    assert torch.equal(sent(weights).nonzero()[:, 1], torch.tensor(sorted(ids)))


def test_rows_are_independent() -> None:
    weights = quantize(nucleus(3, top_p=1.0, top_k=5))
    rebuilt = sent(weights)
    assert torch.equal(rebuilt, as_probabilities(weights))
    assert ((rebuilt > 0).sum(dim=-1) == 5).all()


def test_top_k_keeps_k_tokens_renormalized() -> None:
    q = nucleus(3, top_p=1.0, top_k=64)
    assert ((q > 0).sum(dim=-1) == 64).all()
    assert torch.allclose(q.sum(dim=-1), torch.ones(3))


def q_bytes(q: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in encode_q(quantize(q)).values())


def stream_bytes(q: torch.Tensor) -> int:
    payload = {
        "tokens": torch.tensor([int(q[0].argmax())], dtype=torch.int32),
        "epoch": torch.tensor([0]),
        **encode_q(quantize(q)),
    }
    spec = REGISTRY.spec(SpecMsg.STREAM)
    assert spec is not None
    return encode_frame(spec, payload, 0, 0, Limits())[1]


def test_an_entry_costs_under_three_bytes_and_varints_round_trip() -> None:
    """A language model's nucleus: many entries, close together, most of them small."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    q = probs_from_logits(logits, temperature=0.8, top_p=0.95)
    entries = int((quantize(q) > 0).sum())
    assert q_bytes(q) < 3 * entries + 4  # the row count, then a gap and a weight per entry
    values = torch.tensor([0, 127, 128, 16383, 16384, TOTAL - 1, 2**34])
    assert torch.equal(from_varints(to_varints(values), len(values), "x"), values)
    assert to_varints(torch.tensor([127, 128])).tolist() == [127, 128, 1]  # 7 bits a byte


def test_with_draft_top_k_64_a_32k_vocabulary_token_travels_in_under_a_kibibyte() -> None:
    """The whole STREAM frame of one drafted token, header and q included; a dense float32 row
    would be 125 KiB."""
    assert stream_bytes(nucleus(1, 32_000, top_p=0.95, top_k=64)) <= 1024


def dense(rows: int = 1) -> dict[str, torch.Tensor]:
    return {"q": torch.full((rows, VOCAB), 1.0 / VOCAB)}


def weights_payload(rows, weights, gaps) -> dict[str, torch.Tensor]:
    """q as the drafter sends it: true weights and gaps here, encoded as varints."""
    return {
        "q_rows": torch.tensor(rows, dtype=torch.int32),
        "q_index": to_varints(torch.tensor(gaps, dtype=torch.int64)),
        "q_weight": to_varints(torch.tensor(weights, dtype=torch.int64) - 1),
    }


def raw(payload: dict[str, torch.Tensor], **entries: list[int]) -> dict[str, torch.Tensor]:
    """`payload` with some entries replaced by hand-made bytes."""
    return {**payload, **{k: torch.tensor(v, dtype=torch.uint8) for k, v in entries.items()}}


HALF = TOTAL // 2
ONE = weights_payload([1], [TOTAL], [5])


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({}, "sampling needs q"),
        ({**dense(), **ONE}, "dense .* or as weights"),
        ({"q": torch.ones(1, VOCAB, dtype=torch.int64)}, "float32 or float64"),
        ({"q": torch.ones(2, VOCAB) / VOCAB}, r"shape \(k, vocab_size\)"),
        ({"q": torch.full((1, VOCAB), 0.5)}, "must sum to 1"),
        ({**ONE, "q_rows": torch.tensor([1])}, "int32"),
        (weights_payload([1, 1], [TOTAL, TOTAL], [5, 5]), r"int32 of shape \(k,\)"),
        ({**ONE, "q_weight": torch.tensor([TOTAL - 1], dtype=torch.int32)}, "uint8 vector"),
        ({**ONE, "q_index": torch.tensor([[5]], dtype=torch.uint8)}, "uint8 vector"),
        (weights_payload([0], [], []), "1..1000 entries"),
        (weights_payload([2], [TOTAL], [5]), "exactly 2 varints"),
        (weights_payload([2], [HALF, HALF], [5]), "exactly 2 varints"),
        (weights_payload([2], [HALF, HALF], [5, 0, 1]), "exactly 2 varints"),
        (raw(ONE, q_index=[0x85]), "exactly 1 varints"),
        (raw(ONE, q_index=[0x80] * 7 + [1]), "longer than 1 varints can be"),
        (
            raw(weights_payload([2], [HALF, HALF], [5, 0]), q_index=[0x80] * 5 + [1, 0]),
            "longer than 5 bytes",
        ),
        (weights_payload([1], [TOTAL], [VOCAB]), "ids outside 0..999"),
        (weights_payload([2], [HALF, HALF], [5, VOCAB - 6]), "ids outside 0..999"),
        (raw(ONE, q_weight=[0x80, 0x80, 0x04]), "a weight over 65536"),
        (weights_payload([2], [HALF, HALF - 1], [5, 0]), "sum to exactly 65536"),
        (weights_payload([1], [TOTAL - 1], [5]), "sum to exactly 65536"),
        (weights_payload([2], [HALF, HALF], [6, 0]), "gives a drafted token no probability"),
    ],
    ids=[
        "none",
        "both",
        "dense_integer",
        "dense_shape",
        "dense_not_a_distribution",
        "rows_dtype",
        "rows_shape",
        "weight_dtype",
        "index_shape",
        "empty_row",
        "fewer_weights",
        "fewer_indices",
        "more_indices",
        "unfinished_varint",
        "varints_too_long",
        "varint_too_long",
        "index_over_vocab",
        "second_index_over_vocab",
        "weight_over_total",
        "weights_short",
        "weight_short",
        "drafted_token_outside_support",
    ],
)
def test_a_malformed_q_is_refused_with_its_reason(payload, error: str) -> None:
    with pytest.raises(BadDraftQ, match=error):
        decode_q(payload, [5], VOCAB)


def test_gaps_restart_in_each_row() -> None:
    """Row 2's first index counts from -1 again: 5 is 5, not 5 + 7 + 1."""
    q = decode_q(weights_payload([2, 1], [HALF, HALF, TOTAL], [5, 1, 5]), [5, 5], VOCAB)
    assert q[0, 5] == q[0, 7] == 0.5 and q[1, 5] == 1.0
