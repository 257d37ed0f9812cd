"""The cost models that answer "what would this module do on a link of D ms and B Mbit/s"."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab.linkmodel import INITIAL_WINDOW, Link, parse_rate
from labtools.costmodel import main, predict


def test_rates_read_as_tc_writes_them() -> None:
    assert parse_rate("10mbit") == 10e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("none") is None and parse_rate(None) is None
    for bad in ("fast", "-5mbit", "nanmbit", "infmbit", "0mbit"):
        with pytest.raises(ValueError, match="not a rate"):
            parse_rate(bad)


def test_a_transfer_costs_its_bytes_at_the_rate_and_slow_start_after_idle() -> None:
    link = Link(one_way_s=0.010, rate_bps=1e9)
    small = INITIAL_WINDOW // 2
    assert link.serialize_s(small) == pytest.approx(small * 8 / 1e9)
    assert link.slow_start_s(small) == 0.0  # within the initial window: no wait
    # 1 MB after an idle spell: the window doubles from 10 segments; it covers 1 MB in the 7th
    # flight, so 6 round trips of 20 ms wait on top of the delay and the bytes
    n = 1_000_000
    assert link.serialize_s(n) == pytest.approx(n * 8 / 1e9)
    assert link.slow_start_s(n) == pytest.approx(6 * 0.020)
    # on a thin link the window stops limiting at the bandwidth-delay product (25 kB here)
    thin = Link(one_way_s=0.010, rate_bps=10e6)
    bdp_rounds = math.ceil(math.log2(10e6 / 8 * 0.020 / INITIAL_WINDOW + 1)) - 1
    assert thin.serialize_s(n) == pytest.approx(n * 8 / 10e6)
    assert thin.slow_start_s(n) == pytest.approx(bdp_rounds * 0.020)
    assert Link(one_way_s=0.0, rate_bps=None).serialize_s(n) == 0.0  # uncapped


def split_inference_run(folder: Path, *, token_ms: float, kv_cache: bool = True) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(
        f"split: {{num_stages: 3}}\ngenerate: {{kv_cache: {str(kv_cache).lower()}}}\n"
    )
    summary = {"kind": "summary", "token_ms_p50": token_ms, "bytes_between_stages_per_token": 2e4}
    (folder / "metrics.jsonl").write_text(json.dumps(summary) + "\n")
    return folder


def test_split_inference_pays_two_crossings_per_cut_and_its_activations(tmp_path: Path) -> None:
    run = split_inference_run(tmp_path, token_ms=4.0)
    assert predict("split_inference", run, delay_ms=0, rate=None) == pytest.approx(4.0)
    # 3 stages: 2 cuts, each crossed there and back; 10 kB forward per cut at 10 Mbit/s = 8 ms
    assert predict("split_inference", run, delay_ms=5, rate="10mbit") == pytest.approx(4 + 20 + 16)


def test_the_model_refuses_what_it_does_not_cover(tmp_path: Path) -> None:
    run = split_inference_run(tmp_path, token_ms=4.0, kv_cache=False)
    with pytest.raises(ValueError, match="kv_cache=true"):
        predict("split_inference", run, delay_ms=1, rate=None)
    with pytest.raises(ValueError, match="delay_ms"):
        predict("split_inference", run, delay_ms=float("nan"), rate=None)


def test_the_command_prints_a_prediction_per_link_and_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = split_inference_run(tmp_path / "run", token_ms=4.0)
    assert main(["split_inference", str(run), "--delay-ms", "5", "--rate", "10mbit"]) == 0
    out = capsys.readouterr().out
    assert "4 in the local run" in out and "40" in out.splitlines()[-1]
    assert main(["split_inference", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_the_command_given_another_modules_run_names_whose_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = split_inference_run(tmp_path / "run", token_ms=4.0)
    (run / "lab_run.json").write_text('{"job": "split_inference"}')
    assert main(["spec_decoding", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run} is a run of split_inference, not spec_decoding")
    assert f"python -m labtools.costmodel split_inference {run}" in err
    assert len(err.strip().splitlines()) == 1


def split_training_run(folder: Path, *, stages: int, schedule: str = "gpipe") -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(
        "model: {pretrained: 'lab:tiny_target', lab_preset: debug}\n"
        f"split: {{num_stages: {stages}, schedule: {schedule}, microbatches: 4, "
        "batch_size: 8, block_size: 64, grad_accum_steps: 1}\n"
    )
    steps = [{"kind": "metrics", "step": i, "step_s": 0.080} for i in range(1, 6)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return folder


@pytest.mark.parametrize(
    ("stages", "schedule", "delays"), [(2, "gpipe", 5), (3, "gpipe", 7), (2, "1f1b", 7)]
)
def test_split_training_waits_2p_plus_1_delays_under_gpipe_and_more_under_1f1b(
    tmp_path: Path, stages: int, schedule: str, delays: int
) -> None:
    """The count from the code path (split_training.pipeline): the driver's call, the forward
    down and the backward up the stages, the norm, the answers; 1F1B at 2 stages and 4
    micro-batches waits a second round trip for micro-batches 3 and 4."""
    run = split_training_run(tmp_path, stages=stages, schedule=schedule)
    assert predict("split_training", run, delay_ms=0, rate=None) == pytest.approx(80.0)
    assert predict("split_training", run, delay_ms=10, rate=None) == pytest.approx(80 + 10 * delays)
