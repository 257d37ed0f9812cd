"""The link model tensor_parallel's sweeps and bench predict with: what a link adds to a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.linkmodel import Link
from tensor_parallel.manifest import allreduce_delays, allreduce_on_link_ms, predict_token_ms


def test_an_allreduce_waits_two_delays_a_ring_step_and_sends_its_share_of_the_bytes() -> None:
    # gloo's ring: 2(N - 1) steps, each a receive notice then the data
    assert [allreduce_delays(n) for n in (2, 3, 4)] == [4, 8, 12]
    # 2 ranks, 5 ms one way, 100 Mbit/s: 4 delays, and each rank sends 2(N-1)/N = all 4 KB
    assert allreduce_on_link_ms(4096, 2, Link(0.005, 1e8)) == pytest.approx(20 + 4096 * 8 / 1e5)
    # 4 ranks send 1.5x the tensor each, over 12 delays
    assert allreduce_on_link_ms(4096, 4, Link(0.001, 1e8)) == pytest.approx(12 + 6144 * 8 / 1e5)
    assert allreduce_on_link_ms(4096, 2, Link(0.0, None)) == 0.0


def test_a_local_runs_step_is_predicted_on_a_link_per_allreduce(tmp_path: Path) -> None:
    summary = {
        "kind": "summary",
        "ranks": 2,
        "token_ms": 40.0,
        "allreduces_per_token": 16,
        "allreduce_bytes_per_token": 16 * 4096,
        "batch": 1,
    }
    (tmp_path / "metrics.jsonl").write_text(json.dumps(summary) + "\n")
    on_link = predict_token_ms(tmp_path, Link(0.001, 1e9))
    assert on_link == pytest.approx(40.0 + 16 * (4 * 1.0 + 4096 * 8 / 1e6))
    assert predict_token_ms(tmp_path, Link(0.0, None)) == pytest.approx(40.0)
