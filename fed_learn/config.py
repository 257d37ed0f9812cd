"""fed_learn's config schema (`conf/fed_learn.yaml`)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from fed_learn.aggregate import AGGREGATORS
from fed_learn.compression import COMPRESSIONS
from fed_learn.protocol import TASK_RANGES
from fed_learn.secagg_params import MAX_CLIENTS
from lab.config import (
    Endpoint,
    LabConfig,
    LoRASettings,
    check_choice,
    check_fields_positive,
)

STRATEGIES = ("fedavg", "fedprox", "ffa", "svd")
MODES = ("sync", "async")
PARTITIONS = ("package", "file_type")


@dataclass
class SecAggConfig:
    """fed.secagg: how secure aggregation runs (`fed.secure_aggregation=true`)."""

    neighbors: int = 0
    """Neighbours per client (SecAgg+'s sparse graph); 0: every client of the round (the
    original protocol). Each client's cost grows with its neighbours, not the round's size."""
    threshold: float = 0.5
    """Of a client and its neighbours, the fraction whose shares rebuild its secrets (rounded
    up, at least 2): more than half keeps a coordinator that claims a client dropped from also
    learning its self-mask; lower tolerates more dropouts."""
    step_timeout_s: float = 60.0
    """How long each key, share and unmask step waits for the round's clients (the masked
    inputs wait fed.round_timeout_s, as updates do)."""
    max_clients: int = 1000
    """The most clients one secure round may hold: the coordinator samples at most this many,
    and a client leaves a round whose parameters list more before it builds anything (its
    memory and work grow with the round: roster, graph and, with neighbors=0, one share per
    client)."""

    def __post_init__(self) -> None:
        if self.neighbors < 0:
            raise ValueError(f"fed.secagg.neighbors={self.neighbors} must be >= 0")
        if not 2 <= self.max_clients <= MAX_CLIENTS:
            raise ValueError(
                f"fed.secagg.max_clients={self.max_clients} must be in 2..{MAX_CLIENTS} "
                "(a share's holder index travels as a 16-bit number, 1..65535)"
            )
        if not 0 < self.threshold <= 1:
            raise ValueError(f"fed.secagg.threshold={self.threshold} must be in (0, 1]")
        check_fields_positive("fed.secagg", self, ("step_timeout_s",))


@dataclass
class DPConfig:
    """fed.dp: client-level differential privacy, DP-FedAvg (fed_learn.privacy)."""

    enabled: bool = False
    clip_norm: float = 1.0
    """Each client's update (its adapter minus the global one) is clipped to this L2 norm."""
    noise_multiplier: float = 0.0
    """Noise standard deviation on the round's sum, in units of clip_norm; 0: derived from
    target_epsilon over fed.rounds."""
    target_epsilon: float = 8.0
    delta: float = 1e-5
    weight_cap: int = 256
    """A client weighs min(examples, weight_cap): the cap bounds what one client moves."""
    accountant: str = "rdp"
    """Opacus's accountant: rdp | prv."""

    def __post_init__(self) -> None:
        from fed_learn.privacy import ACCOUNTANTS

        check_choice("fed.dp.accountant", self.accountant, ACCOUNTANTS)
        if not 0 < self.clip_norm < math.inf:
            raise ValueError(f"fed.dp.clip_norm={self.clip_norm} must be finite and > 0")
        if not 0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"fed.dp.noise_multiplier={self.noise_multiplier} must be >= 0")
        if self.enabled and self.noise_multiplier == 0 and not self.target_epsilon > 0:
            raise ValueError("fed.dp: set noise_multiplier > 0 or target_epsilon > 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"fed.dp.delta={self.delta} must be in (0, 1)")
        check_fields_positive("fed.dp", self, ("weight_cap",))


@dataclass
class FedConfig:
    coordinator: Endpoint = field(default_factory=lambda: Endpoint(port=29510))
    """Where the coordinator listens and its clients dial (TCP). Its host defaults to
    cluster.master.host (conf/fed_learn.yaml), so a cluster file names the serving host once;
    a local run picks a free port."""
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
    idle_join_budget: int = 16
    """JOINs whose session has handed in no update, per address range (IPv4 /24, IPv6 /64,
    all of 127/8 as one) and per claimed client index, between two rounds that count; past it
    that range's or index's JOINs are refused. Never fewer than num_clients. Any secret holder
    can claim any index, so it can spend another client's index budget (its reconnection)."""
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
    simulate: int = 0
    """Local runs: virtual clients per simulator process (Flower-style simulation: each with
    its own shard, seed, connection and keys, sharing one copy of the model and taking turns
    to train); 0: one process per client. 100 clients at simulate=50 are 2 processes."""
    simulate_dropout: float = 0.0
    """Simulated clients only: the chance that a client drops out of a round after the round
    began and before its update (it leaves and joins again for a later round), to see what
    dropouts cost; drawn per client and round from the run's seed."""
    secure_aggregation: bool = False
    """The coordinator learns only each round's weighted sum of updates (fed_learn.secagg):
    clients clip their own updates to fed.max_update_norm (the coordinator cannot check one)."""
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    server_optimizer: str = "none"
    """What the coordinator does with a round's aggregate (fed_learn.server_opt, FedOpt): none
    (it is the next global adapter) | avgm (server momentum) | adam | yogi | adagrad; the
    aggregate minus the global adapter is the optimizer's pseudo-gradient."""
    server_lr: float = 0.0
    """The server optimizer's learning rate; 0: its default (Flower's): 1.0 for avgm, 0.1 for
    adam, yogi and adagrad."""
    server_beta1: float = 0.9
    """First moment's decay (adam, yogi, adagrad); avgm's momentum."""
    server_beta2: float = 0.99
    """Second moment's decay (adam, yogi)."""
    server_tau: float = 1e-3
    """adam, yogi, adagrad: added to sqrt(v), it sets how adaptive the step is (Reddi et al.
    2021 tune it on {1e-1, ..., 1e-5}; small: each coordinate moves about server_lr)."""
    partition: str = "package"
    """Local runs: how the lab's stand-in data is dealt to clients: package (whole test packages
    of the stdlib test suite, unequal shares) | file_type (the test suite's text files by type:
    .py, .decTest, the others, a type per client: heterogeneous clients)."""
    evaluate_on_clients: bool = False
    """Federated evaluation: every eval_every rounds, sampled clients evaluate the global adapter
    on their own held-out shard and send loss and token count (fed_learn.evaluation)."""
    fraction_evaluate: float = 1.0
    """Of the clients connected, the fraction asked to evaluate (at least one)."""
    eval_every: int = 1
    """Federated evaluation after every this many rounds (and after the last)."""

    def __post_init__(self) -> None:
        self.coordinator.check("fed.coordinator")
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
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"fed.lr={self.lr} must be a finite number > 0")
        for key, (low, high) in TASK_RANGES.items():  # what a client accepts in a TASK
            if not low <= getattr(self, key) <= high:
                raise ValueError(f"fed.{key}={getattr(self, key)} must be in [{low}, {high}]")
        if self.simulate < 0:
            raise ValueError(f"fed.simulate={self.simulate} must be >= 0")
        if not 0 <= self.simulate_dropout < 1:
            raise ValueError(f"fed.simulate_dropout={self.simulate_dropout} must be in [0, 1)")
        if self.simulate_dropout and not self.simulate:
            raise ValueError("fed.simulate_dropout applies to simulated clients (fed.simulate)")
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
                "idle_join_budget",
            ),
        )
        if not 0 < self.fraction_fit <= 1:
            raise ValueError(f"fed.fraction_fit={self.fraction_fit} must be in (0, 1]")
        if self.min_fit_clients > self.num_clients:
            raise ValueError(
                f"fed.min_fit_clients={self.min_fit_clients} is more than fed.num_clients="
                f"{self.num_clients}: no round could ever close; raise fed.num_clients or lower "
                "fed.min_fit_clients"
            )
        if not 0 < self.join_rate_per_address < math.inf:
            raise ValueError(
                f"fed.join_rate_per_address={self.join_rate_per_address} must be finite and > 0"
            )
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError("fed.heartbeat_timeout_s must exceed fed.heartbeat_s")
        self._check_secure()
        self._check_dp()
        self._check_server_optimizer()
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

    def _check_server_optimizer(self) -> None:
        """fed.server_optimizer and federated evaluation: their own keys and what they need."""
        from fed_learn.server_opt import SERVER_OPTIMIZERS

        check_choice("fed.server_optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        check_choice("fed.partition", self.partition, PARTITIONS)
        if not 0 <= self.server_lr < math.inf:
            raise ValueError(f"fed.server_lr={self.server_lr} must be finite and >= 0")
        if self.server_optimizer == "none" and self.server_lr not in (0, 1):
            raise ValueError(
                f"fed.server_lr={self.server_lr} with fed.server_optimizer=none: plain averaging "
                "has no learning rate; choose fed.server_optimizer=avgm|adam|yogi|adagrad"
            )
        for key in ("server_beta1", "server_beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"fed.{key}={getattr(self, key)} must be in [0, 1)")
        if not 0 < self.server_tau < math.inf:
            raise ValueError(f"fed.server_tau={self.server_tau} must be finite and > 0")
        if self.server_optimizer != "none":
            for key, applies, why in (
                ("fed.mode=async", self.mode == "async", "mixes in one update at a time"),
                ("fed.strategy=svd", self.strategy == "svd", "re-factorizes the products each "
                 "round, so A and B's coordinates do not mean the same from one round to the "
                 "next"),
            ):  # fmt: skip
                if applies:
                    raise ValueError(
                        f"fed.server_optimizer={self.server_optimizer} with {key}: a server "
                        f"optimizer steps on each round's mean update, and {key.split('=')[0]} "
                        f"{why}; use fed.strategy=fedavg|fedprox|ffa in sync mode"
                    )
        if not 0 < self.fraction_evaluate <= 1:
            raise ValueError(f"fed.fraction_evaluate={self.fraction_evaluate} must be in (0, 1]")
        check_fields_positive("fed", self, ("eval_every",))
        if self.evaluate_on_clients and self.mode == "async":
            raise ValueError(
                "fed.evaluate_on_clients=true with fed.mode=async: async clients always hold a "
                "training task, so none is free to evaluate; use fed.mode=sync"
            )

    def _check_dp(self) -> None:
        """What DP-FedAvg (`privacy.DPMean` around the strategy, or the clients' noise under
        secure aggregation) cannot do: it noises a clipped, weighted sum of updates."""
        if not self.dp.enabled:
            return
        cannot = {
            "fed.mode=async": "each update is applied alone: no round's sum to noise",
            f"fed.aggregator={self.aggregator}": "one client can move an order statistic by "
            "more than the clip: the noise is calibrated to a sum's sensitivity",
            "fed.strategy=svd": "the mean of products B @ A has no sensitivity the clip bounds",
        }
        applies = {
            "fed.mode=async": self.mode == "async",
            f"fed.aggregator={self.aggregator}": self.aggregator != "mean",
            "fed.strategy=svd": self.strategy == "svd",
        }
        for key, why in cannot.items():
            if applies[key]:
                raise ValueError(f"fed.dp.enabled=true with {key}: {why}")

    def _check_secure(self) -> None:
        """Secure aggregation gives the coordinator a sum: what needs single updates is
        refused with the reason."""
        if not self.secure_aggregation:
            return
        if self.min_fit_clients > self.secagg.max_clients:
            raise ValueError(
                f"fed.min_fit_clients={self.min_fit_clients} is more than "
                f"fed.secagg.max_clients={self.secagg.max_clients}: no secure round could close; "
                "raise fed.secagg.max_clients or lower fed.min_fit_clients"
            )
        needs = {
            "fed.mode=async": "applies each update as it arrives",
            f"fed.aggregator={self.aggregator}": "takes coordinate-wise order statistics",
            "fed.strategy=svd": "re-factorizes the average of products B @ A, not a sum of "
            "the tensors clients send",
            f"fed.compression={self.compression}": "sends sparse updates whose coordinates "
            "differ per client",
        }
        applies = {
            "fed.mode=async": self.mode == "async",
            f"fed.aggregator={self.aggregator}": self.aggregator != "mean",
            "fed.strategy=svd": self.strategy == "svd",
            f"fed.compression={self.compression}": self.compression != "none",
        }
        for key, why in needs.items():
            if applies[key]:
                raise ValueError(
                    f"fed.secure_aggregation=true with {key}: the coordinator only sees the "
                    f"round's sum, and {key.split('=')[0]} {why}"
                )


@dataclass
class FedLearnRunConfig(LabConfig):
    """Schema of `conf/fed_learn.yaml`."""

    fed: FedConfig = field(default_factory=FedConfig)
    lora: LoRASettings = field(default_factory=LoRASettings)
    client_index: int = 0
    """role=client: which shard of the corpus this client holds (a real client: its own data)."""
    client_name: str = ""
