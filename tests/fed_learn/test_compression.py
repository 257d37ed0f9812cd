"""Top-k with error feedback loses nothing; int8 stays within half a step; bytes shrink."""

from __future__ import annotations

import pytest
import torch

from fed_learn.compression import ErrorFeedback, compress, decompress, wire_bytes
from lab.sparse import quantize_int8, sparse_with_feedback, topk


def test_topk_keeps_the_largest_magnitudes() -> None:
    indices, values = topk(torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2]), fraction=0.4)
    assert sorted(indices.tolist()) == [1, 3]
    assert sorted(values.tolist()) == [-5.0, 4.0]


@pytest.mark.parametrize("method", ["topk", "topk_int8"])
def test_error_feedback_keeps_the_residual(method: str) -> None:
    torch.manual_seed(0)
    shapes = {"a": torch.Size([8, 16]), "b": torch.Size([32, 8])}
    feedback = ErrorFeedback()
    total_update = {k: torch.zeros(s) for k, s in shapes.items()}
    total_sent = {k: torch.zeros(s) for k, s in shapes.items()}
    for _ in range(5):
        update = {k: torch.randn(s) for k, s in shapes.items()}
        sent = decompress(
            feedback.compress(update, method=method, fraction=0.1), method=method, shapes=shapes
        )
        for key in shapes:
            total_update[key] += update[key]
            total_sent[key] += sent[key]
    for key in shapes:  # everything is either sent or still owed
        torch.testing.assert_close(
            total_sent[key] + feedback.residual[key], total_update[key], rtol=1e-5, atol=1e-5
        )
        assert feedback.residual[key].abs().sum() > 0


def test_int8_error_is_at_most_half_a_step() -> None:
    values = torch.randn(1000)
    q, scale = quantize_int8(values)
    assert q.dtype == torch.int8
    assert (q.float() * scale - values).abs().max() <= scale / 2 + 1e-7


def test_topk_int8_sends_many_times_fewer_bytes() -> None:
    update = {"a": torch.randn(64, 256), "b": torch.randn(256, 64)}
    dense = wire_bytes(compress(update, method="none", fraction=1.0))
    sparse = wire_bytes(compress(update, method="topk_int8", fraction=0.02))
    assert dense / sparse > 10


def test_int8_scales_apply_to_their_own_tensor() -> None:
    update = {"b": torch.tensor([0.0, 100.0, 0.0]), "a": torch.tensor([0.01, 0.0, -0.02, 0.0])}
    wire = compress(update, method="topk_int8", fraction=0.5)
    assert set(wire) == {"idx", "val", "scale"} and wire["scale"].numel() == 2
    sent = decompress(wire, method="topk_int8", shapes={k: v.shape for k, v in update.items()})
    torch.testing.assert_close(sent["a"], update["a"], atol=1e-4, rtol=0)  # not b's scale
    torch.testing.assert_close(sent["b"], torch.tensor([0.0, 100.0, 0.0]))


SHAPES = {"a": torch.Size([4]), "b": torch.Size([2])}


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        ({"idx": torch.tensor([0, 6], dtype=torch.int32), "val": torch.ones(2)}, "out of range"),
        ({"idx": torch.tensor([-1], dtype=torch.int32), "val": torch.ones(1)}, "out of range"),
        ({"idx": torch.tensor([0, 1], dtype=torch.int32), "val": torch.ones(3)}, "paired"),
        ({"idx": torch.tensor([0], dtype=torch.int64), "val": torch.ones(1)}, "int32"),
        ({"idx": torch.tensor([0], dtype=torch.int32)}, "tensors"),
        ({"a.idx": torch.tensor([0], dtype=torch.int32), "a.val": torch.ones(1)}, "tensors"),
    ],
)
def test_decompress_refuses_updates_that_do_not_fit_the_adapter(wire, match) -> None:
    with pytest.raises(ValueError, match=match):
        decompress(wire, method="topk", shapes=SHAPES)


def test_decompress_refuses_a_scale_per_tensor_mismatch() -> None:
    wire = {
        "idx": torch.tensor([0], dtype=torch.int32),
        "val": torch.ones(1, dtype=torch.int8),
        "scale": torch.ones(3),
    }
    with pytest.raises(ValueError, match="scales for 2"):
        decompress(wire, method="topk_int8", shapes=SHAPES)


def test_sparse_with_feedback_keeps_every_residual_exactly() -> None:
    torch.manual_seed(0)
    values, residual = torch.randn(1000), torch.randn(1000) * 0.1
    indices, kept, remaining = sparse_with_feedback(values, residual, fraction=0.05)
    sent = torch.zeros(1000)
    sent[indices.long()] = kept
    assert indices.numel() == 50
    assert torch.equal(sent + remaining, values + residual)  # nothing lost, bit for bit
    assert torch.all(remaining[indices.long()] == 0)
