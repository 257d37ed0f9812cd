"""dp.sync=diloco: DDP's special case where it must be, communication at syncs only, its outer
state through a resume, and uneven machines balanced by their measured speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_parallel.config import DataParallelRunConfig
from data_parallel.manifest import step_records
from data_parallel.steps import balanced_inner_steps
from data_parallel.worker import due
from lab.config import to_settings

from .conftest import Run, compose_dp, losses, worst_relative

PAIR = ("dp.workers=2", "dp.batch_size=2", "dp.grad_accum_steps=1")
SGD = ("dp.optimizer=sgd", "dp.lr=0.5", "dp.grad_clip=0")
"""Plain SGD with a step large enough that the losses move (so an equality means something);
no clipping (DiLoCo clips each worker's own gradients, DDP the sum)."""
AS_DDP = ("dp.sync=diloco", "dp.inner_steps=1", "dp.outer_lr=1", "dp.outer_momentum=0")
DILOCO = ("dp.sync=diloco", "dp.inner_steps=5")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_one_inner_sgd_step_and_a_plain_outer_step_is_ddp_with_sgd(
    dp_run: Run, workers: int
) -> None:
    """H = 1, inner SGD, outer lr 1 and momentum 0: the averaged pseudo-gradient is lr times
    the averaged gradient, so every step is DDP's, loss for loss."""
    shape = (f"dp.workers={workers}", *PAIR[1:])
    ddp, diloco = losses(dp_run(*shape, *SGD)), losses(dp_run(*shape, *SGD, *AS_DDP))
    assert sorted(diloco) == list(range(1, 11))
    assert worst_relative(diloco, ddp) < 1e-5
    # the steps moved the model (the same batches, barely trained, lose otherwise), so the
    # equality is not one of two runs that did nothing
    frozen = losses(dp_run(*shape, *SGD[:1], "dp.lr=1e-9", *SGD[2:]))
    assert worst_relative(ddp, frozen) > 1e-2


def test_diloco_communicates_at_its_syncs_only_and_trains(dp_run: Run) -> None:
    run = dp_run(*PAIR, *DILOCO)
    sent = {int(r["step"]): r["comm_bytes"] for r in step_records(run, "comm_bytes")}
    assert [s for s, b in sorted(sent.items()) if b > 0] == [5, 10]
    assert sorted(losses(run)) == [5, 10]
    assert losses(run)[10] < losses(run)[5]
    assert summary(run)["syncs"] == 2 and summary(run)["inner_steps"] == 5


@pytest.mark.slow
def test_an_fp16_or_int8_pseudo_gradient_is_a_half_or_a_quarter_of_the_bytes(dp_run: Run) -> None:
    run = dp_run(*PAIR, *DILOCO)
    numel = step_records(run, "comm_bytes")[4]["comm_bytes"] / 4  # fp32, and a few fp64 numbers
    half = dp_run(*PAIR, *DILOCO, "dp.pseudo_grad_dtype=fp16")
    assert step_records(half, "comm_bytes")[4]["comm_bytes"] == pytest.approx(numel * 2, rel=1e-3)
    assert worst_relative(losses(half), losses(run)) < 1e-2
    quarter = dp_run(*PAIR, *DILOCO, "dp.pseudo_grad_dtype=int8")
    assert step_records(quarter, "comm_bytes")[4]["comm_bytes"] == pytest.approx(numel, rel=1e-3)
    assert worst_relative(losses(quarter), losses(run)) < 3e-2


def test_a_resumed_diloco_run_has_the_uninterrupted_losses(dp_run: Run, tmp_path: Path) -> None:
    """The step-5 checkpoint holds the outer momentum and each worker's inner AdamW: a resume
    from it repeats steps 6-10 exactly (a lost inner state would change them)."""
    import shutil

    original = dp_run(*PAIR, *DILOCO)
    copy = tmp_path / "resumed"
    shutil.copytree(original, copy)
    (copy / "agent" / "checkpoints" / "latest.json").write_text(
        json.dumps({"step": 5, "folder": "step-000005"})
    )
    dp_run(*PAIR, *DILOCO, "dp.resume=true", fresh=True, run_dir=copy)
    assert worst_relative({10: losses(copy)[10]}, losses(original)) < 1e-6
    assert worst_relative(losses(copy, "worker_loss"), losses(original, "worker_loss")) < 1e-6


def test_a_checkpoint_of_another_sync_is_refused_before_anything_starts(
    dp_run: Run, tmp_path: Path, lab_cache: Path
) -> None:
    from data_parallel.run import check

    checkpoints = dp_run(*PAIR) / "agent" / "checkpoints"  # DDP's
    settings = to_settings(compose_dp(tmp_path, lab_cache, (*PAIR, *DILOCO, "dp.resume=true",
                                      "dp.steps=20", f"dp.checkpoint_dir={checkpoints}")),
                           DataParallelRunConfig)  # fmt: skip
    with pytest.raises(ValueError, match=r"written with dp\.sync=ddp.*resume it with dp\.sync="):
        check(settings)


def test_a_slow_worker_takes_fewer_inner_steps_and_weighs_by_its_tokens(dp_run: Run) -> None:
    """dp.slow_worker=1:3 (worker 1 sleeps twice its compute): the first round measures (both
    take H = 5 steps), then each round gives worker 1 the inner steps its measured speed earns
    (balanced_inner_steps of the seconds the round recorded), and the sync weighs by them. The
    counts follow from the seconds the run measured, not from how busy the machine was."""
    run = dp_run(*PAIR, "dp.sync=diloco", "dp.inner_steps=5", "dp.balance=tokens",
                 "dp.slow_worker=1:3", "dp.steps=15")  # fmt: skip
    rounds = {int(r["step"]): r for r in step_records(run, "inner_steps")}
    assert sorted(rounds) == [5, 10, 15]
    assert rounds[5]["inner_steps"] == 5  # measuring: every worker 5 steps of 2 blocks
    assert rounds[5]["round_blocks"] == 20
    for before, after in ((5, 10), (10, 15)):
        measured = [rounds[before]["worker0_step_s"], rounds[before]["worker1_step_s"]]
        assert all(s > 0 for s in measured)
        steps = [balanced_inner_steps(measured, 5, rank) for rank in (0, 1)]
        assert max(steps) == 5  # the faster one (rank 0 but on a very busy machine) takes H
        assert rounds[after]["inner_steps"] == steps[0]  # (rank 0's own count)
        # each trained its share, 2 blocks a step: the blocks the sync weighed by
        assert rounds[after]["round_blocks"] == 2 * sum(steps)
    assert summary(run)["syncs"] == 3


def test_balanced_inner_steps_give_each_worker_its_speeds_share() -> None:
    assert balanced_inner_steps([0.1, 0.2], 50, 0) == 50
    assert balanced_inner_steps([0.1, 0.2], 50, 1) == 25
    assert balanced_inner_steps([0.1, 10.0], 50, 1) == 1  # never none
    assert balanced_inner_steps([0.0, 0.0], 50, 1) == 50  # nothing measured yet


def test_what_falls_due_between_syncs_is_done_at_the_next() -> None:
    assert due(10, 8, 12, 100) and not due(10, 12, 16, 100) and due(10, 96, 100, 100)
    assert not due(0, 0, 100, 100)


STREAMING = (*DILOCO, "dp.fragments=2", "dp.overlap_steps=1")
"""H = 5, two fragments: fragment 0 starts its sync at steps 2 and 7, fragment 1 at 5; each
lands one step later; at step 10 (the last) everything syncs at once."""


def test_streaming_syncs_a_fragment_at_a_time_and_lands_each_a_step_later(dp_run: Run) -> None:
    whole = dp_run(*PAIR, *DILOCO)
    run = dp_run(*PAIR, *STREAMING)
    sent = {int(r["step"]): r["comm_bytes"] for r in step_records(run, "comm_bytes")}
    assert [s for s, b in sorted(sent.items()) if b > 0] == [2, 5, 7, 10]
    full = step_records(whole, "comm_bytes")[4]["comm_bytes"]  # the whole model, at step 5
    assert sent[2] + sent[5] == pytest.approx(full, rel=1e-3)
    assert 0.2 * full < sent[2] < 0.8 * full  # a share, not all or nothing
    assert sent[10] == pytest.approx(full, rel=1e-3)  # the last step: every fragment
    assert sorted(losses(run)) == [3, 6, 8, 10]  # each sync's loss when it lands
    # it trains: the validation loss falls from the untrained model's (the frozen run above)
    # by at least a third of what DDP's ten steps take off it (ours: 0.027 of 0.067)
    untrained = summary(dp_run(*PAIR, *SGD[:1], "dp.lr=1e-9", *SGD[2:]))["val_loss"]
    ddp = summary(dp_run(*PAIR, "dp.engine=ddp"))["val_loss"]  # the exactness tests' run
    assert untrained - summary(run)["val_loss"] > (untrained - ddp) / 3


def test_a_streaming_run_resumed_mid_flight_has_the_uninterrupted_losses(
    dp_run: Run, tmp_path: Path
) -> None:
    """The step-5 checkpoint is written while fragment 1's sync (started at 5) is in flight and
    fragment 0 has trained 3 steps apart: the checkpoint's model is the global one, each
    worker's own parameters, the sync's sum and its tokens are in its part, and a resume
    repeats steps 6-10."""
    import shutil

    original = dp_run(*PAIR, *STREAMING)
    copy = tmp_path / "resumed"
    shutil.copytree(original, copy)
    checkpoints = copy / "agent" / "checkpoints"
    (checkpoints / "latest.json").write_text(json.dumps({"step": 5, "folder": "step-000005"}))
    import torch

    part = torch.load(checkpoints / "step-000005" / "rank-1.pt", weights_only=True)
    assert "diloco/flight/1/summed" in part and "diloco/flight/0/summed" not in part
    dp_run(*PAIR, *STREAMING, "dp.resume=true", fresh=True, run_dir=copy)
    later = range(6, 11)
    assert worst_relative({s: v for s, v in losses(copy).items() if s in later},
                          losses(original)) < 1e-6  # fmt: skip
    assert worst_relative({s: v for s, v in losses(copy, "worker_loss").items() if s in later},
                          losses(original, "worker_loss")) < 1e-6  # fmt: skip


def test_fragments_are_contiguous_runs_of_about_equal_size_each_synced_once_a_round() -> None:
    from data_parallel.diloco import cut_fragments, fragment_offset

    assert cut_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert cut_fragments([5] + [1] * 9, 2) == [[0, 1, 2], list(range(3, 10))]
    assert cut_fragments([100, 1, 1], 3) == [[0], [1], [2]]  # never an empty one
    for numels, count in (([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1] * 7, 7), ([8], 1)):
        runs = cut_fragments(numels, count)
        assert [i for run in runs for i in run] == list(range(len(numels)))
        assert len(runs) == count and all(runs)
    with pytest.raises(ValueError, match="3 fragments of 2 parameters"):
        cut_fragments([1, 1], 3)
    for fragments, inner in ((1, 5), (2, 5), (4, 10), (5, 5)):
        offsets = [fragment_offset(f, fragments, inner) for f in range(fragments)]
        assert len(set(offsets)) == fragments and offsets[-1] == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dp.fragments=2", r"dp\.fragments and dp\.overlap_steps are for dp\.sync=diloco"),
        ("dp.sync=diloco dp.inner_steps=4 dp.fragments=5", r"dp\.fragments=5 must be at most"),
        ("dp.sync=diloco dp.inner_steps=4 dp.overlap_steps=4", r"dp\.overlap_steps=4 must be"),
        ("dp.sync=diloco dp.overlap_mix=1.5", r"dp\.overlap_mix=1\.5 must be in \[0, 1\]"),
        ("dp.sync=diloco dp.fragments=2 dp.balance=tokens", r"dp\.balance=tokens needs rounds"),
        ("dp.slow_worker=one", r"dp\.slow_worker='one' must be RANK:FACTOR"),
        ("dp.outer_momentum=1", r"dp\.outer_momentum=1\.0 must be below 1"),
        ("dp.pseudo_grad_dtype=int4", r"dp\.pseudo_grad_dtype"),
    ],
)
def test_a_bad_diloco_setting_is_one_error_naming_its_key(
    tmp_path: Path, lab_cache: Path, override: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        to_settings(compose_dp(tmp_path, lab_cache, tuple(override.split())),
                    DataParallelRunConfig)  # fmt: skip


def test_auto_picks_ddp_on_a_fast_link_and_diloco_on_a_slow_one() -> None:
    """The choice follows the link: 1 M parameters, 100 ms of compute a step, three workers."""
    from data_parallel.autosync import Measured, choose, settings_of

    fast = Measured(one_way_s=0.0001, rate_bps=10e9, compute_s=0.1, numel=1_000_000, workers=3)
    slow = Measured(one_way_s=0.010, rate_bps=10e6, compute_s=0.1, numel=1_000_000, workers=3)
    assert choose(fast)[0] == "ddp"
    method, reason = choose(slow)
    assert method == "diloco:50:5:8"  # its syncs hidden behind 8 steps of compute
    assert settings_of(method) == {"sync": "diloco", "inner_steps": 50, "fragments": 5,
                                   "overlap_steps": 8}  # fmt: skip
    assert reason.startswith("dp.sync=auto chose diloco:50:5:8:") and "\n" not in reason
    assert "10.0 ms one-way, 10 Mbit/s" in reason
    # dp.balance=tokens cannot stream: the best of the others
    assert choose(slow, streaming=False)[0] in ("diloco:25", "diloco:50")


def test_auto_reads_a_links_rate_from_the_bytes_time_and_never_an_impossible_one() -> None:
    """Timed all-reduces (injected: one element, a quarter of the probe, the probe) to the
    figures `auto` prints: on a 10 ms, 10 Mbit/s link its delay and rate; on loopback, where
    the bytes' time is lost in each call's fixed cost, at least what the probe moved (it
    printed 8,388,608 Mbit/s: a rate cut down to 1 microsecond of wire time)."""
    from data_parallel.autosync import PROBE_BYTES, link_from_times

    bits = 8 * PROBE_BYTES  # what a worker of two sends of the probe (2(N-1)/N of it)
    wire = lambda nbits: nbits / 10e6  # noqa: E731
    one_way, rate = link_from_times(0.02, 0.04 + wire(bits / 4), 0.04 + wire(bits), workers=2)
    assert one_way == pytest.approx(0.010) and rate == pytest.approx(10e6)
    one_way, rate = link_from_times(0.0002, 0.0009, 0.0010, workers=2)  # loopback
    assert one_way == pytest.approx(0.0001)
    assert rate == pytest.approx(bits / 0.0010) and rate / 1e6 < 10_000  # 8,389 Mbit/s


def test_auto_measures_chooses_says_why_and_trains(
    dp_run: Run, capfd: pytest.CaptureFixture[str]
) -> None:
    run = dp_run(*PAIR, "dp.sync=auto", fresh=True)
    said = [line for line in capfd.readouterr().out.splitlines() if "dp.sync=auto chose" in line]
    assert len(said) == 1, said  # once, by rank 0
    config = json.loads((run / "agent" / "checkpoints" / "step-000010" / "meta.json").read_text())
    chosen = config["config"]["dp"]["sync"]
    assert chosen in ("ddp", "powersgd", "topk", "diloco")  # what it ran is what it saved
    assert f"chose {chosen}" in said[0]
    assert sorted(losses(run))[-1] == 10


def test_the_cost_model_hides_a_streamed_sync_behind_the_steps_that_overlap_it() -> None:
    from data_parallel.autosync import Measured, predict_step_s

    slow = Measured(one_way_s=0.010, rate_bps=10e6, compute_s=0.1, numel=1_000_000, workers=3)
    whole = predict_step_s("diloco:50", slow)
    unhidden = predict_step_s("diloco:50:5:0", slow)  # five syncs of a fifth: more delays
    assert whole < unhidden < whole * 1.1
    assert predict_step_s("diloco:50:5:8", slow) < whole  # 0.8 s of compute hides most of each
    assert predict_step_s("diloco:50:5:49", slow) == pytest.approx(0.1)  # all of it
    with pytest.raises(ValueError, match="no cost model"):
        predict_step_s("diloco:50:5", slow)
