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


def test_the_grid_says_which_part_of_a_step_grew_on_a_slower_link() -> None:
    """bench/tensor_parallel_bench.py sets each cell's all-reduce against the model's and its
    compute against the loopback cell's (a step that grew by more than the model's delays says
    where); a results file from before the parts were recorded prints as before."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "tensor_parallel_bench.py"
    spec = importlib.util.spec_from_file_location("tensor_parallel_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row_tp = {"allreduces": 44.0, "allreduce_bytes": 8192}
    runs = [  # rank 0's summaries: the loopback cell, then 5 ms with the compute doubled
        {"token_ms": 370.0, "allreduces_per_token": 44.0, "collective_ms_per_token": 140.8,
         "compute_ms_per_token": 230.0},
        {"token_ms": 1500.0, "allreduces_per_token": 44.0,
         "collective_ms_per_token": 44 * (3.2 + 4 * 5.0), "compute_ms_per_token": 460.0},
    ]  # fmt: skip
    cells = [
        {"delay_ms": 0.0, "rate": "1gbit", "measured_ms": 370.0, **bench.step_parts(runs[:1])},
        {"delay_ms": 5.0, "rate": "1gbit", "measured_ms": 1500.0, **bench.step_parts(runs[1:])},
    ]
    lines = bench.parts_lines(bench.model_grid(cells, row_tp), row_tp)
    assert len(lines) == 2 and "4.00 one-way delays, the model 4" in lines[1]
    assert "(1.00;" in lines[1] and "(2.00x;" in lines[1]
    old = [{k: c[k] for k in ("delay_ms", "rate", "measured_ms")} for c in cells]
    assert bench.parts_lines(bench.model_grid(old, row_tp), row_tp) == []
