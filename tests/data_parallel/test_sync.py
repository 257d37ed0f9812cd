"""dp.sync: torch's compression hooks under data_parallel's summed gradients, their bytes, and
the start-up check that gloo sums a half-precision dtype right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from data_parallel.config import DataParallelRunConfig
from data_parallel.manifest import step_records
from data_parallel.sync import check_dtype
from lab.cli import ConfigError
from lab.config import to_settings

from .conftest import Run, compose_dp, losses, worst_relative

PAIR = ("dp.workers=2", "dp.batch_size=2", "dp.grad_accum_steps=1", "dp.engine=ddp")


def test_fp16_all_reduce_trains_as_fp32_does_to_its_rounding_with_half_the_bytes(
    dp_run: Run,
) -> None:
    reference, half = dp_run(*PAIR), dp_run(*PAIR, "dp.sync=fp16")
    assert worst_relative(losses(half), losses(reference)) < 1e-2
    norm = worst_relative(losses(half, "grad_norm"), losses(reference, "grad_norm"))
    assert norm < 1e-2  # a sum, as fp32's: torch's hook's division by the world size undone
    fp32 = step_records(reference, "comm_bytes")[-1]["comm_bytes"]
    assert step_records(half, "comm_bytes")[-1]["comm_bytes"] == pytest.approx(fp32 / 2, rel=1e-3)


@pytest.mark.slow
def test_bf16_all_reduce_trains_as_fp32_does_to_its_rounding(dp_run: Run) -> None:
    reference, half = dp_run(*PAIR), dp_run(*PAIR, "dp.sync=bf16")
    assert worst_relative(losses(half), losses(reference)) < 3e-2


def test_powersgd_is_the_plain_sum_before_its_start_step_and_a_tenth_of_the_bytes_after(
    dp_run: Run,
) -> None:
    reference = dp_run(*PAIR)
    low_rank = dp_run(*PAIR, "dp.sync=powersgd", "dp.powersgd_start_step=4",
                      "dp.powersgd_rank=2")  # fmt: skip
    ours, theirs = losses(low_rank), losses(reference)
    # steps 1-3: torch's plain all-reduce, scaled back to a sum: the same losses and gradient
    # norms (AdamW after clipping hides a gradient's scale; the norm does not)
    assert worst_relative({s: ours[s] for s in (1, 2, 3)}, theirs) < 1e-6
    norms, their_norms = losses(low_rank, "grad_norm"), losses(reference, "grad_norm")
    assert worst_relative({s: norms[s] for s in (1, 2, 3)}, their_norms) < 1e-6
    assert all(torch.isfinite(torch.tensor(list(ours.values()))))
    sent = {int(r["step"]): float(r["comm_bytes"]) for r in step_records(low_rank, "comm_bytes")}
    full = step_records(reference, "comm_bytes")[-1]["comm_bytes"]
    assert sent[2] == pytest.approx(full, rel=1e-3)
    assert max(sent[s] for s in range(5, 11)) < full / 5


def test_a_start_step_below_two_with_error_feedback_is_one_line(
    tmp_path: Path, lab_cache: Path
) -> None:
    with pytest.raises(ValueError, match=r"^dp.powersgd_start_step=1 must be >= 2") as info:
        to_settings(compose_dp(tmp_path, lab_cache, ("dp.powersgd_start_step=1",)),
                    DataParallelRunConfig)  # fmt: skip
    assert "\n" not in str(info.value)


@pytest.fixture
def one_process_group(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sync", ["fp16", "bf16"])
def test_a_backend_that_sums_a_dtype_wrong_is_refused_at_start_up(
    one_process_group: None, sync: str
) -> None:
    check_dtype(sync)  # gloo here: right

    def broken(tensor: torch.Tensor) -> None:  # what a broken kernel did: half the values lost
        tensor[::2] = 0

    with pytest.raises(ConfigError, match=rf"^dp.sync={sync}: .* gave a wrong sum") as info:
        check_dtype(sync, all_reduce=broken)
    assert "\n" not in str(info.value)


def test_topk_of_everything_is_the_plain_sum_and_of_a_twentieth_a_tenth_of_the_bytes(
    dp_run: Run,
) -> None:
    reference = dp_run(*PAIR)
    everything = dp_run(*PAIR, "dp.sync=topk", "dp.topk_fraction=1.0")
    assert worst_relative(losses(everything), losses(reference)) < 1e-6
    assert worst_relative(losses(everything, "grad_norm"), losses(reference, "grad_norm")) < 1e-6
    sparse = dp_run(*PAIR, "dp.sync=topk", "dp.topk_fraction=0.05")
    full = step_records(reference, "comm_bytes")[-1]["comm_bytes"]
    sent = step_records(sparse, "comm_bytes")[-1]["comm_bytes"]
    assert sent == pytest.approx(full / 10, rel=0.05)  # indices and values: 2 x 5%
    assert worst_relative(losses(sparse), losses(reference)) < 0.1  # trains, not diverges


def test_top_k_error_feedback_keeps_every_residual() -> None:
    """Over several steps, what was sent plus what each parameter still keeps is every
    gradient given, exactly: nothing is lost, only delayed."""
    from data_parallel.sync import compress_bucket

    generator = torch.Generator().manual_seed(0)
    parts = [("a", 50), ("b", 7), ("c", 200)]
    residuals: dict[str, torch.Tensor] = {}
    given = torch.zeros(257)
    sent = torch.zeros(257)
    for _ in range(4):
        grads = torch.randn(257, generator=generator)
        given += grads
        indices, values = compress_bucket(grads, parts, residuals, fraction=0.1)
        assert indices.numel() == 5 + 1 + 20  # ceil(10%) of each parameter, not of the bucket
        sent.index_add_(0, indices.long(), values)
    kept = torch.cat([residuals[name] for name, _ in parts])
    assert torch.allclose(sent + kept, given, atol=1e-6)
    assert kept.abs().sum() > 0  # something is still waiting: the test is not of k = everything


def test_a_resumed_top_k_run_has_the_uninterrupted_losses(dp_run: Run, tmp_path: Path) -> None:
    """Each worker's residuals are in the step-5 checkpoint (`rank-<r>.pt`): a resume from it
    repeats steps 6-10 (without them, or with a per-bucket choice that DDP's first-step buckets
    change, it would not)."""
    import json
    import shutil

    original = dp_run(*PAIR, "dp.sync=topk", "dp.topk_fraction=0.05")
    copy = tmp_path / "resumed"
    shutil.copytree(original, copy)
    checkpoints = copy / "agent" / "checkpoints"
    assert sorted(p.name for p in (checkpoints / "step-000005").glob("rank-*.pt")) == [
        "rank-0.pt", "rank-1.pt"]  # fmt: skip
    (checkpoints / "latest.json").write_text(json.dumps({"step": 5, "folder": "step-000005"}))
    dp_run(*PAIR, "dp.sync=topk", "dp.topk_fraction=0.05", "dp.resume=true", fresh=True,
           run_dir=copy)  # fmt: skip
    resumed = losses(copy)
    assert worst_relative({s: resumed[s] for s in range(6, 11)}, losses(original)) < 1e-6


def test_a_resumed_powersgd_run_has_the_uninterrupted_losses(dp_run: Run, tmp_path: Path) -> None:
    """PowerSGD's state (each worker's error feedback, the warm start's factors, its step count
    and seed generator) is in the step-5 checkpoint, kept per parameter: a resume from it, whose
    first step runs on DDP's initial buckets (not the rebuilt ones torch keyed the state by),
    repeats steps 6-10. (Without the state, steps 6-10 differed from the uninterrupted run's by
    more than 1e-5: the error feedback and the factors started over.)"""
    import json
    import shutil

    settings = (*PAIR, "dp.sync=powersgd", "dp.powersgd_start_step=4", "dp.powersgd_rank=2")
    original = dp_run(*settings)  # the plain-sum test's run
    copy = tmp_path / "resumed"
    shutil.copytree(original, copy)
    checkpoints = copy / "agent" / "checkpoints"
    (checkpoints / "latest.json").write_text(json.dumps({"step": 5, "folder": "step-000005"}))
    state = torch.load(checkpoints / "step-000005" / "rank-1.pt", weights_only=True)
    assert int(state["iter"]) == 5
    errors = [v for k, v in state.items() if k.startswith("error/")]
    factors = [v for k, v in state.items() if k.startswith("factor/")]
    assert errors and factors and any(e.abs().sum() > 0 for e in errors)  # state worth keeping
    dp_run(*settings, "dp.resume=true", fresh=True, run_dir=copy)
    resumed = losses(copy)
    assert worst_relative({s: resumed[s] for s in range(6, 11)}, losses(original)) < 1e-6


def test_powersgd_with_several_buckets_in_flight_keeps_every_workers_collectives_in_order(
    dp_run: Run,
) -> None:
    """torch's PowerSGD issues its P and Q all-reduces from callbacks: with several buckets in
    flight, three workers interleaved them differently and gloo aborted the run. Small buckets
    (many of them) and three workers must train."""
    run = dp_run("dp.workers=3", "dp.batch_size=2", "dp.sync=powersgd", "dp.bucket_cap_mb=0.05",
                 "dp.powersgd_start_step=2")  # fmt: skip
    trained = losses(run)
    assert sorted(trained) == list(range(1, 11))
    assert all(torch.isfinite(torch.tensor(list(trained.values()))))
    collectives = step_records(run, "collectives")[-1]["collectives"]
    assert collectives > 3  # several buckets did cross
