"""fed_learn's config schema (`conf/fed_learn.yaml`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fed_learn.compression import COMPRESSIONS
from lab.config import (
    LabConfig,
    LoRASettings,
    check_choice,
    check_fields_positive,
    register_schema,
)

STRATEGIES = ("fedavg", "fedprox", "ffa", "svd")
MODES = ("sync", "async")


@dataclass
class FedConfig:
    strategy: str = "fedavg"
    """fedavg | fedprox (proximal term) | ffa (A frozen: exact) | svd (products re-factorized)"""
    rounds: int = 3
    num_clients: int = 3
    """Clients a local run starts (each with its own non-IID shard of the corpus)."""
    fraction_fit: float = 1.0
    min_fit_clients: int = 2
    round_timeout_s: float = 300.0
    wait_clients_s: float = 120.0
    """How long to wait for min_fit_clients to be connected before a round (then: error)."""
    local_epochs: int = 1
    local_steps: int = 0
    """If > 0, at most this many optimizer steps per round (quick runs)."""
    batch_size: int = 8
    lr: float = 3e-3
    prox_mu: float = 0.01
    max_examples_per_client: int = 256
    data_dir: str = ""
    """role=client: fine-tune on the text files under this folder (this machine's private
    data). Empty: the lab's stand-in, client_index's shard of the stdlib test suite."""
    data_glob: str = "**/*"
    """Which files under data_dir (binary files are skipped)."""
    eval_blocks: int = 32
    heartbeat_s: float = 2.0
    heartbeat_timeout_s: float = 30.0
    """A client silent this long is dead and left out of later rounds."""
    compression: str = "none"
    """none | topk | topk_int8: clients send the top-k of their update (delta from the global
    adapter), keeping the rest as error feedback for later rounds; int8 also quantizes it."""
    topk_fraction: float = 0.05
    mode: str = "sync"
    """sync: rounds wait for the sampled clients; async: every update is applied as it arrives
    (mixed into the global adapter, weighted down by staleness) and its client is sent the new
    global adapter at once; a "round" is then min_fit_clients applied updates."""
    max_staleness: int = 4
    """async: refuse an update trained from a global adapter more than this many updates old."""
    async_mixing: float = 0.5
    """async: weight of a fresh (staleness 0) update when mixed into the global adapter."""
    staleness_exponent: float = 0.5
    """async: an update s versions old is mixed with weight async_mixing * (1 + s)^-exponent
    (FedAsync's polynomial staleness function)."""
    resume: bool = False
    """Continue from the last completed round's checkpoint in the run directory."""
    centralized_baseline: bool = True
    """Local runs: also train the same model on all clients' data pooled in one place (the
    same number of gradient steps) and report federated / centralized validation loss."""

    def __post_init__(self) -> None:
        check_choice("fed.strategy", self.strategy, STRATEGIES)
        check_choice("fed.compression", self.compression, COMPRESSIONS)
        check_choice("fed.mode", self.mode, MODES)
        if self.mode == "async" and self.strategy == "svd":
            raise ValueError(
                "fed.strategy=svd aggregates a round's updates together; fed.mode=async mixes "
                "them one at a time: use fedavg, fedprox or ffa"
            )
        if self.max_staleness < 0 or self.staleness_exponent < 0:
            raise ValueError("fed.max_staleness and fed.staleness_exponent must be >= 0")
        if not 0 < self.async_mixing <= 1:
            raise ValueError(f"fed.async_mixing={self.async_mixing} must be in (0, 1]")
        if not 0 < self.topk_fraction <= 1:
            raise ValueError(f"fed.topk_fraction={self.topk_fraction} must be in (0, 1]")
        check_fields_positive(
            "fed",
            self,
            (
                "rounds",
                "num_clients",
                "min_fit_clients",
                "local_epochs",
                "batch_size",
                "max_examples_per_client",
                "eval_blocks",
            ),
        )
        if not 0 < self.fraction_fit <= 1:
            raise ValueError(f"fed.fraction_fit={self.fraction_fit} must be in (0, 1]")
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError("fed.heartbeat_timeout_s must exceed fed.heartbeat_s")


@dataclass
class FedLearnRunConfig(LabConfig):
    """Schema of `conf/fed_learn.yaml`."""

    fed: FedConfig = field(default_factory=FedConfig)
    lora: LoRASettings = field(default_factory=LoRASettings)
    client_index: int = 0
    """role=client: which shard of the corpus this client holds (a real client: its own data)."""
    client_name: str = ""


register_schema("fed_learn_schema", FedLearnRunConfig)
