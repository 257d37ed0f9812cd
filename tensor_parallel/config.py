"""tensor_parallel's config schema (`conf/tensor_parallel.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.config import LabConfig, check_choice, check_fields_positive

ENGINES = ("local", "dtensor")
DEFAULT_PROMPTS = [
    "def main(",
    "import os\nimport sys\n",
    "class Queue:\n    def __init__(self",
    "    for item in ",
]


def parse_cpus(text: str) -> set[int]:
    """`0-1,3` -> {0, 1, 3}; ValueError naming tp.cpus otherwise."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"tp.cpus={text!r} must list cores, e.g. 0 or 0-1,3") from None
    return cpus


@dataclass
class TPConfig:
    """How many ranks share each layer, and what they generate."""

    ranks: int = 2
    """Ranks the model is split over: a local run starts this many processes on loopback (each
    its share of the cores); with role=rank, the ranks of the whole job (one per host)."""
    rank: int = 0
    """role=rank: this host's rank, 0 .. tp.ranks - 1 (rank 0 serves the rendezvous at
    cluster.master and writes the run's records)."""
    cpus: str = ""
    """Cores this rank runs on (`0`, `0-1,3`: os.sched_setaffinity); "": every core it may use.
    A local run gives each rank its own (its share of this process's)."""
    engine: str = "local"
    """Who holds the shards: local, plain tensors and torch's dist.all_reduce after each
    rowwise linear; dtensor, torch's tensor-parallel engine (parallelize_module,
    ColwiseParallel / RowwiseParallel, DTensor weights). The same sums either way;
    bench/tensor_parallel_bench.py times both (DTensor's dispatch costs per linear)."""
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    """Prompts, generated as one left-padded batch."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy; above 0: sampled (one seed, rank 0's, used alike on every rank)."""
    top_p: float = 1.0
    repeats: int = 2
    """Generations of the batch measured (after one warm-up); their decode steps pooled."""
    baseline: bool = True
    """Rank 0 also runs the unsplit model on its own cores (the other ranks idle): the ratio's
    baseline, and a check that greedy output is the same."""
    join_timeout_s: int = 60
    """Seconds to wait for every rank at cluster.master."""

    def __post_init__(self) -> None:
        check_fields_positive("tp", self, ("ranks", "max_new_tokens", "repeats", "join_timeout_s"))
        check_choice("tp.engine", self.engine, ENGINES)
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"tp.rank={self.rank} must be in 0 .. tp.ranks - 1 ({self.ranks - 1})")
        if self.temperature < 0:
            raise ValueError(f"tp.temperature={self.temperature} must be >= 0 (0: greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"tp.top_p={self.top_p} must be in (0, 1]")
        if self.cpus:
            parse_cpus(self.cpus)
        if not self.prompts or not all(self.prompts):
            raise ValueError("tp.prompts must hold at least one non-empty prompt")


@dataclass
class TensorParallelRunConfig(LabConfig):
    """Schema of `conf/tensor_parallel.yaml`."""

    tp: TPConfig = field(default_factory=TPConfig)
