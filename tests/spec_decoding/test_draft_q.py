"""q on the wire: the support travels, the verifier rebuilds exactly the q the drafter sampled
from, and every malformed sparse q is refused with its reason."""

from __future__ import annotations

import pytest
import torch

from lab.sampling import probs_from_logits
from netproto.wire import REGISTRY, Limits, encode_frame
from spec_decoding.draft_q import BadDraftQ, decode_q, encode_q, index_dtype
from spec_decoding.protocol import SpecMsg

VOCAB = 1000


def nucleus(k: int = 2, vocab: int = VOCAB, *, top_p: float = 0.9, top_k: int = 0, seed: int = 0):
    logits = torch.randn(k, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    return probs_from_logits(logits, temperature=0.8, top_p=top_p, top_k=top_k)


def test_a_sparse_q_comes_back_bit_for_bit() -> None:
    q = nucleus()
    payload = encode_q(q)
    assert set(payload) == {"q_rows", "q_index", "q_value"}
    assert payload["q_index"].dtype == torch.uint16
    draft = [int(row.argmax()) for row in q]
    assert torch.equal(decode_q(payload, draft, VOCAB), q)


def test_a_q_over_most_of_the_vocabulary_goes_dense() -> None:
    q = nucleus(top_p=1.0)  # every token has some probability
    payload = encode_q(q)
    assert set(payload) == {"q"}
    assert torch.equal(decode_q(payload, [0, 1], VOCAB), q)


def test_a_vocabulary_past_uint16_gets_int32_indices() -> None:
    assert index_dtype(2**16) == torch.uint16
    assert index_dtype(2**16 + 1) == torch.int32
    q = nucleus(1, 70_000, top_k=8)
    payload = encode_q(q)
    assert payload["q_index"].dtype == torch.int32
    assert torch.equal(decode_q(payload, [int(q[0].argmax())], 70_000), q)


def test_top_k_keeps_k_tokens_renormalized() -> None:
    q = nucleus(3, top_p=1.0, top_k=64)
    assert ((q > 0).sum(dim=-1) == 64).all()
    assert torch.allclose(q.sum(dim=-1), torch.ones(3))


def stream_bytes(q: torch.Tensor) -> int:
    payload = {
        "tokens": torch.tensor([int(q[0].argmax())], dtype=torch.int32),
        "epoch": torch.tensor([0]),
        **encode_q(q),
    }
    spec = REGISTRY.spec(SpecMsg.STREAM)
    assert spec is not None
    return encode_frame(spec, payload, 0, 0, Limits())[1]


def test_with_draft_top_k_64_a_32k_vocabulary_token_travels_in_under_a_kibibyte() -> None:
    """The whole STREAM frame of one drafted token, header and q included; dense it is 128 KiB."""
    q = nucleus(1, 32_000, top_p=0.95, top_k=64)
    assert stream_bytes(q) <= 1024
    assert stream_bytes(nucleus(1, 32_000, top_p=1.0)) > 32_000 * 4


def sparse(rows, index, value, *, index_dtype=torch.int32) -> dict[str, torch.Tensor]:
    return {
        "q_rows": torch.tensor(rows, dtype=torch.int32),
        "q_index": torch.tensor(index, dtype=index_dtype),
        "q_value": torch.tensor(value, dtype=torch.float32),
    }


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({}, "sampling needs q"),
        ({"q": torch.ones(1, 4) / 4, **sparse([1], [5], [1.0])}, "dense .* or sparse"),
        ({**sparse([1], [5], [1.0]), "q_rows": torch.tensor([1])}, "`q_rows` must be int32"),
        (sparse([1, 1], [5, 6], [1.0, 1.0]), r"`q_rows` must be int32 of shape \(k,\)"),
        ({**sparse([1], [5], [1.0]), "q_index": torch.tensor([5.0])}, "uint16 or int32"),
        (
            {**sparse([1], [5], [1.0]), "q_value": torch.tensor([1.0], dtype=torch.float64)},
            "float32",
        ),
        (sparse([1], [5], [0.5, 0.5]), "as long as `q_index`"),
        (sparse([0], [], []), "1..1000 entries"),
        (sparse([1001], list(range(1001)), [1 / 1001] * 1001), "1..1000 entries"),
        (sparse([2], [5], [1.0]), "add up to the entries"),
        (sparse([1], [1000], [1.0]), "outside 0..999"),
        (sparse([1], [-1], [1.0]), "outside 0..999"),
        (sparse([2], [5, 5], [0.5, 0.5]), "ascend strictly"),
        (sparse([2], [6, 5], [0.5, 0.5]), "ascend strictly"),
        (sparse([2], [5, 6], [1.0, 0.0]), "finite, positive"),
        (sparse([2], [5, 6], [2.0, -1.0]), "finite, positive"),
        (sparse([1], [5], [float("nan")]), "finite, positive"),
        (sparse([1], [5], [float("inf")]), "finite, positive"),
        (sparse([2], [5, 6], [0.5, 0.25]), "must sum to 1"),
        (sparse([2], [6, 7], [0.5, 0.5]), "gives a drafted token no probability"),
    ],
    ids=[
        "none",
        "both",
        "rows_dtype",
        "rows_shape",
        "index_dtype",
        "value_dtype",
        "value_length",
        "empty_row",
        "row_over_vocab",
        "count_mismatch",
        "index_over_vocab",
        "index_negative",
        "index_twice",
        "index_descending",
        "value_zero",
        "value_negative",
        "value_nan",
        "value_inf",
        "not_a_distribution",
        "drafted_token_outside_support",
    ],
)
def test_a_malformed_sparse_q_is_refused_with_its_reason(payload, error: str) -> None:
    with pytest.raises(BadDraftQ, match=error):
        decode_q(payload, [5], VOCAB)


def test_rows_ascend_independently() -> None:
    """Row 2 may start below where row 1 ended: only indices within a row must ascend."""
    q = decode_q(sparse([2, 2], [7, 9, 3, 4], [0.5, 0.5, 0.25, 0.75]), [7, 4], VOCAB)
    assert q[0, 7] == q[0, 9] == 0.5 and q[1, 3] == 0.25 and q[1, 4] == 0.75
