"""Which blocks each worker trains on: a pure function of the seed, the step's position in the
data and the worker's rank, so a restarted, resumed or resharded run sees the same batches.

The training blocks are read as one endless stream: epoch after epoch, each a seeded permutation
of every block. A step takes the next `global_batch` blocks of the stream, micro-step by
micro-step; within a micro-step, rank r takes the r-th slice of `batch_size` blocks:

    stream:  ... | step s: [micro 0: rank 0 | rank 1 | ...][micro 1: rank 0 | rank 1 | ...] | ...

So N workers with batch b see, together, exactly the micro-batches one process with batch N*b
sees, in the same order. The uneven end of an epoch (its blocks rarely divide by the global
batch) is neither dropped nor run as a short step: the step that crosses it takes the last
blocks of one epoch and the first of the next. Every step has the same number of blocks, every
block is seen once per epoch, and no worker ever waits on a smaller share than another.

Positions count blocks, not steps: a run resumed with another number of workers (another global
batch) goes on from the block where the checkpoint stopped.

With dp.balance=tokens (DDP on uneven machines) a step takes the same global batch, cut instead
into one contiguous share per rank, each share its worker's speed's part (`balanced_shares`),
trained in micro-batches of at most `batch_size`:

    stream:  ... | step s: [rank 0: 12 blocks | rank 1: 4 blocks] | ...

The step's blocks, and so its gradient, are those of the even cut: only who computes which
changes.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stream:
    """The seeded order of `num_blocks` training blocks, epoch after epoch."""

    num_blocks: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 1")

    @functools.cache  # noqa: B019  (a handful of epochs per run, the stream lives as long)
    def epoch(self, number: int) -> tuple[int, ...]:
        order = list(range(self.num_blocks))
        random.Random(f"{self.seed}:{number}").shuffle(order)
        return tuple(order)

    def take(self, start: int, count: int) -> list[int]:
        """Block indices at stream positions [start, start + count)."""
        return [
            self.epoch(position // self.num_blocks)[position % self.num_blocks]
            for position in range(start, start + count)
        ]


def rank_micro_batches(
    stream: Stream, position: int, *, rank: int, world_size: int, batch_size: int, accum: int
) -> list[list[int]]:
    """Rank `rank`'s block indices for each micro-step of the step starting at stream
    `position` (the step takes world_size * batch_size * accum blocks)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    micro = world_size * batch_size
    return [stream.take(position + m * micro + rank * batch_size, batch_size) for m in range(accum)]


def global_batch(world_size: int, batch_size: int, accum: int) -> int:
    """Blocks one optimizer step trains on, over every worker."""
    return world_size * batch_size * accum


def gather_blocks(blocks: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """(len(indices), T) rows of `blocks` (N, T)."""
    return blocks[torch.tensor(indices, dtype=torch.long)]  # (b, T)


def balanced_shares(seconds_per_block: list[float], total: int) -> list[int]:
    """`total` blocks cut among the ranks in proportion to their speeds (1 / seconds a block),
    at least one each, rounded by largest remainder (ties to the lower rank): every rank
    computes the same cut from the same measured times. Equal shares where a rank has not been
    measured (0)."""
    ranks = len(seconds_per_block)
    if ranks < 1 or total < ranks:
        raise ValueError(f"{total} blocks cannot give each of {ranks} ranks one")
    if any(not s > 0 or s != s or s == float("inf") for s in seconds_per_block):
        speeds = [1.0] * ranks
    else:
        speeds = [1.0 / s for s in seconds_per_block]
    spare = total - ranks  # one block each first
    ideal = [spare * v / sum(speeds) for v in speeds]
    shares = [1 + int(x) for x in ideal]
    order = sorted(range(ranks), key=lambda r: (-(ideal[r] - int(ideal[r])), r))
    for rank in order[: total - sum(shares)]:
        shares[rank] += 1
    return shares


def rank_share_micro_batches(
    stream: Stream, position: int, *, shares: list[int], rank: int, batch_size: int
) -> list[list[int]]:
    """Rank `rank`'s contiguous share of the step starting at stream `position`
    (dp.balance=tokens), in micro-batches of at most `batch_size` blocks."""
    if not 0 <= rank < len(shares):
        raise ValueError(f"rank {rank} is outside a world of {len(shares)}")
    start = position + sum(shares[:rank])
    blocks = stream.take(start, shares[rank])
    return [blocks[i : i + batch_size] for i in range(0, len(blocks), batch_size)]
