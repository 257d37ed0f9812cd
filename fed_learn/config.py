"""fed_learn's config schema (`conf/fed_learn.yaml`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from fed_learn.aggregate import AGGREGATORS
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
    aggregator: str = "mean"
    """How a round combines its clients' adapters: mean (weighted by each client's examples,
    FedAvg) | median | trimmed_mean, coordinate-wise and unweighted, robust to a misbehaving
    minority (Yin et al. 2018). Applied per tensor for fedavg/fedprox, to B for ffa and to the
    products B @ A for svd; not with fed.mode=async (one update at a time) nor with top-k
    compression (most coordinates of a sparse update are unsent: their median is no change)."""
    trim_fraction: float = 0.2
    """aggregator=trimmed_mean: the fraction of clients' values dropped at each end, per
    coordinate (floor(trim_fraction * clients) each side), in [0, 0.5)."""
    max_update_norm: float = 10_000.0
    """An update whose L2 distance from the global adapter it was trained from (all tensors
    together) is above this is refused as that client's failure; each round logs the largest
    admitted one (`largest_update_norm`). Always on, against finite but absurd values (3e38)
    that would swamp any average; the robust aggregators are the defence against subtler ones.
    No honest update of the lab's runs comes near it: 3.5 at most in the debug model's default
    run (17k adapter entries; fedavg, fedprox, ffa and svd alike), and AdamW moves an entry by
    about lr per step at most, so Llama-3-8B's 21M entries after the default 32 steps at lr 3e-3
    stay under 0.1 * sqrt(21M) = 440."""
    max_examples_per_client: int = 256
    """Clients' local data cap (local runs) and the most examples, hence averaging weight,
    the coordinator credits a client with, whatever it declares."""
    data_dir: str = ""
    """role=client: fine-tune on the text files under this folder (this machine's private
    data). Empty: the lab's stand-in, client_index's shard of the stdlib test suite."""
    data_glob: str = "**/*"
    """Which files under data_dir (binary files are skipped)."""
    eval_blocks: int = 32
    heartbeat_s: float = 2.0
    heartbeat_timeout_s: float = 30.0
    """A client silent this long is dead and left out of later rounds."""
    join_rate_per_address: float = 1.0
    """JOINs a second one address may make, once its burst is spent; the coordinator answers
    the others `rate_limited` and closes them. Honest clients JOIN once per connection; this
    bounds what a secret holder joining and leaving in a loop costs."""
    join_burst_per_address: int = 32
    """JOINs one address may make at once (a token bucket refilled at join_rate_per_address).
    Never fewer than num_clients: a whole roster behind one address (a local run, a NAT, a
    restarted coordinator's clients dialing again) joins together."""
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
        check_choice("fed.aggregator", self.aggregator, AGGREGATORS)
        if self.aggregator != "mean" and self.mode == "async":
            raise ValueError(
                f"fed.aggregator={self.aggregator} combines a round's updates coordinate by "
                "coordinate; fed.mode=async mixes them in one at a time: use fed.aggregator=mean"
            )
        if self.aggregator != "mean" and self.compression != "none":
            raise ValueError(
                f"fed.aggregator={self.aggregator} with fed.compression={self.compression}: a "
                f"sparse top-k update leaves most coordinates unsent, so their "
                f"{self.aggregator.replace('_', ' ')} is the old value whatever the clients "
                "learned; use fed.compression=none or fed.aggregator=mean"
            )
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"fed.trim_fraction={self.trim_fraction} must be in [0, 0.5)")
        if not 0 < self.max_update_norm < math.inf:
            raise ValueError(f"fed.max_update_norm={self.max_update_norm} must be finite and > 0")
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
                "join_burst_per_address",
            ),
        )
        if not 0 < self.fraction_fit <= 1:
            raise ValueError(f"fed.fraction_fit={self.fraction_fit} must be in (0, 1]")
        if not 0 < self.join_rate_per_address < math.inf:
            raise ValueError(
                f"fed.join_rate_per_address={self.join_rate_per_address} must be finite and > 0"
            )
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError("fed.heartbeat_timeout_s must exceed fed.heartbeat_s")
        per_round = max(self.min_fit_clients, math.ceil(self.num_clients * self.fraction_fit))
        if self.aggregator == "trimmed_mean" and int(self.trim_fraction * per_round) == 0:
            warnings.warn(
                f"fed.aggregator=trimmed_mean with fed.trim_fraction={self.trim_fraction} trims "
                f"nothing from {per_round} clients a round (floor({self.trim_fraction} x "
                f"{per_round}) = 0): it is a plain unweighted mean; raise fed.trim_fraction to "
                f"at least {1 / per_round:.2f} or use fed.aggregator=median",
                UserWarning,
                stacklevel=2,
            )


@dataclass
class FedLearnRunConfig(LabConfig):
    """Schema of `conf/fed_learn.yaml`."""

    fed: FedConfig = field(default_factory=FedConfig)
    lora: LoRASettings = field(default_factory=LoRASettings)
    client_index: int = 0
    """role=client: which shard of the corpus this client holds (a real client: its own data)."""
    client_name: str = ""


register_schema("fed_learn_schema", FedLearnRunConfig)
