"""The split config both split experiments share (`split:` in `conf/split_inference.yaml` and
`conf/split_training.yaml`): how the model is cut and how its stages talk."""

from __future__ import annotations

from dataclasses import dataclass, field

from lab.config import check_choice, check_fields_positive

BALANCES = ("params", "memory")
WIRE_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRANSPORTS = ("tcp", "auto")
CHANNELS = ("basic", "auto", "network")
MAX_STAGES = 16
MIN_RPC_THREADS = 4
"""Fewest TensorPipe threads a split run may ask for (see `SplitConfig.rpc_threads`)."""


@dataclass
class SplitConfig:
    """How the model is cut and how its stages talk (split_training's config extends it)."""

    num_stages: int = 2
    """Stage processes (hosts); the driver is one more RPC worker on top."""
    boundaries: list[int] = field(default_factory=list)
    """First layer of every stage after the first, e.g. [2] puts layers 0-1 on stage 1 and the
    rest on stage 2. Empty: balanced automatically (see `balance`)."""
    balance: str = "params"
    """params: equal parameter counts (embeddings and LM head included); memory: parameter counts
    proportional to each stage host's free memory (asked over RPC at start)."""
    rank: int = 0
    """role=stage: this process's RPC rank, 1..num_stages (the driver is rank 0)."""
    wire_dtype: str = "auto"
    """dtype of activations between stages; auto = the stages' compute dtype. bfloat16 or
    float16 halve the bytes on the wire at a small cost in precision."""
    rpc_timeout_s: float = 60.0
    """Longest wait for any one RPC. A stage that dies is reported sooner, by heartbeats (lost
    after heartbeat_timeout_s unanswered, or this if shorter: split_engine/liveness.py)."""
    heartbeat_timeout_s: float = 4.0
    """How long a peer's heartbeat may go unanswered before the peer is taken as gone (a
    process answers from a thread of its own, so a busy one answers too). Raise it where a
    live process may stall that long (a host swapping hard; a test that stops a run's
    processes on purpose)."""
    join_timeout_s: float = 300.0
    """Longest wait for every stage and the driver to meet at `cluster.master` at start-up."""
    rpc_threads: int = 16
    """TensorPipe worker threads per process (at least 4: a stage holds one for a whole
    generation or training step while its peers' calls and pushes need others)."""
    transport: str = "tcp"
    """tcp: TensorPipe's TCP transport, as between real hosts; auto: TensorPipe picks (shared
    memory between processes of one host)."""
    channels: str = "basic"
    """What carries tensors over that transport. basic: tensors inline on the transport's one
    connection, as between real hosts; the only choice that opens no listener but TensorPipe's
    own (world.fence). auto: TensorPipe's choice, `cma` (process_vm_readv) between processes of
    one machine, plus `mpt_uv`'s 16 lane listeners a process; network: `mpt_uv`, then `basic`.
    Both open those 16 more listeners, reachable by whoever reaches the run's address."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_stages <= MAX_STAGES:
            raise ValueError(f"split.num_stages={self.num_stages} must be in 1..{MAX_STAGES}")
        if self.boundaries and len(self.boundaries) != self.num_stages - 1:
            raise ValueError(
                f"split.boundaries={list(self.boundaries)} must hold num_stages-1="
                f"{self.num_stages - 1} layer indices (or be empty to balance automatically)"
            )
        if any(b <= a for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)):
            raise ValueError(f"split.boundaries={list(self.boundaries)} must increase strictly")
        check_choice("split.balance", self.balance, BALANCES)
        check_choice("split.wire_dtype", self.wire_dtype, WIRE_DTYPES)
        check_choice("split.transport", self.transport, TRANSPORTS)
        check_choice("split.channels", self.channels, CHANNELS)
        if not 0 <= self.rank <= self.num_stages:
            raise ValueError(f"split.rank={self.rank} must be in 1..{self.num_stages} for a stage")
        check_fields_positive(
            "split", self, ("rpc_timeout_s", "join_timeout_s", "heartbeat_timeout_s")
        )
        if self.rpc_threads < MIN_RPC_THREADS:
            raise ValueError(
                f"split.rpc_threads={self.rpc_threads}: at least {MIN_RPC_THREADS} (a stage "
                "holds one thread for a whole generation or training step, and its peers' "
                "calls into it need others: with one, a training step waits out "
                "split.rpc_timeout_s and fails)"
            )


UNREAD = {
    "cluster.link": "netproto's link emulator shapes netproto traffic only, and TensorPipe's "
    "traffic between stages does not cross it",
    "cluster.tls": "TensorPipe does not use netproto's TLS (see docs/security.md)",
}
"""Keys of a split module's schema that it does not read (both split manifests say so)."""
