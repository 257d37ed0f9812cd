"""dp.balance=tokens with DDP: a slow machine computes fewer of each step's blocks, the step's
gradient stays the even cut's, and the cut is one every worker computes alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_parallel.config import DataParallelRunConfig
from data_parallel.data import (
    Stream,
    balanced_shares,
    global_batch,
    rank_micro_batches,
    rank_share_micro_batches,
)
from lab.config import to_settings

from .conftest import Run, compose_dp, losses, worst_relative

PAIR = ("dp.workers=2", "dp.batch_size=2", "dp.grad_accum_steps=1", "dp.engine=ddp")


def test_shares_follow_speed_at_least_one_block_each_and_sum_to_the_batch() -> None:
    assert balanced_shares([0.1, 0.1], 16) == [8, 8]
    assert balanced_shares([0.1, 0.3], 16) == [12, 4]  # three times as slow: a quarter
    assert balanced_shares([0.1, 100.0], 16) == [15, 1]  # never nothing
    assert balanced_shares([0.0, 0.2], 16) == [8, 8]  # not measured yet: even
    assert balanced_shares([0.1, 0.1, 0.1], 16) == [6, 5, 5]  # ties to the lower rank
    for seconds in ([0.3, 0.1, 0.7], [1e-9, 5.0, 5.0, 0.01], [0.2] * 5):
        shares = balanced_shares(seconds, 17)
        assert sum(shares) == 17 and min(shares) >= 1
    with pytest.raises(ValueError, match="cannot give each of 3 ranks one"):
        balanced_shares([0.1, 0.1, 0.1], 2)


@pytest.mark.parametrize(
    ("shares", "accum"), [([2, 2], 1), ([3, 1], 1), ([7, 1], 2), ([1, 1, 4], 1), ([5, 6, 1], 2)]
)
def test_the_shares_together_are_the_even_cuts_blocks(shares: list[int], accum: int) -> None:
    """Who computes which block changes; the step's blocks (so its gradient) do not."""
    stream = Stream(13, seed=3)
    world, batch = len(shares), 2
    assert global_batch(world, batch, accum) == sum(shares)
    for position in (0, 11, 24):
        even = [i for r in range(world) for m in rank_micro_batches(stream, position, rank=r,
                world_size=world, batch_size=batch, accum=accum) for i in m]  # fmt: skip
        cut = [rank_share_micro_batches(stream, position, shares=shares, rank=r, batch_size=batch)
               for r in range(world)]  # fmt: skip
        assert sorted(i for micro in cut for m in micro for i in m) == sorted(even)
        assert all(len(m) <= batch for micro in cut for m in micro)
        assert [sum(len(m) for m in micro) for micro in cut] == shares


def test_a_slow_worker_computes_fewer_blocks_and_the_losses_stay_ddps(dp_run: Run) -> None:
    """dp.slow_worker=1:10: worker 1 takes ten times as long a block; after the first step,
    which measures, each step's four blocks are cut by the seconds a block the workers
    measured (balanced_shares of the seconds each step recorded: the counts follow from the
    run, not from how busy the machine was), and every step's loss and gradient norm are still
    the even run's (the same blocks, summed in another order)."""
    even = dp_run(*PAIR)
    balanced = dp_run(*PAIR, "dp.balance=tokens", "dp.slow_worker=1:10")
    assert worst_relative(losses(balanced), losses(even)) < 1e-5
    assert worst_relative(losses(balanced, "grad_norm"), losses(even, "grad_norm")) < 1e-5
    own, fewest = losses(balanced, "own_blocks"), losses(balanced, "fewest_blocks")
    assert own[1] == 2 and fewest[1] == 2  # nothing measured yet: the even cut
    seconds = {s: [losses(balanced, f"worker{r}_block_s")[s] for r in (0, 1)] for s in own}
    assert seconds[1] == [0.0, 0.0] and all(x > 0 for s in range(2, 11) for x in seconds[s])
    for step in range(2, 11):
        cut = balanced_shares(seconds[step], 4)
        assert (own[step], fewest[step]) == (cut[0], min(cut)), (step, seconds[step])


def test_balance_is_refused_for_fsdp_in_one_line(tmp_path: Path, lab_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"^dp.balance=tokens is for dp.engine=ddp: FSDP2") as e:
        to_settings(compose_dp(tmp_path, lab_cache, ("dp.engine=fsdp", "dp.balance=tokens")),
                    DataParallelRunConfig)  # fmt: skip
    assert "\n" not in str(e.value)
