"""Config schemas shared by every module, registered in Hydra's ConfigStore.

Each YAML file under ``conf/`` is merged into one of these dataclasses, so a wrong type or an
unknown key fails while Hydra composes the config (naming the key), and a value outside its
allowed set fails in ``__post_init__`` when ``run()`` turns the config into objects
(:func:`to_settings`), before any work starts.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
"""The repository's config tree (the package is installed editable)."""

log = logging.getLogger(__name__)

SECRET_ENV = "LAB_SECRET"
"""Environment variable read for the shared secret when `cluster.secret` is not set."""
REDACTED = "***"
"""What every file the lab writes shows instead of the secret (`lab.redact`); as the value of
`cluster.secret` it means "the secret is in LAB_SECRET"."""


def check_choice(field_name: str, value: str, allowed: Iterable[str]) -> None:
    """Raise ValueError naming the field and its allowed values when `value` is not one."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{field_name}={value!r} is not allowed; choose one of {list(allowed)}")


def is_loopback(host: str) -> bool:
    """`host` is this machine's loopback (`localhost`, 127.0.0.0/8, ::1), not a network address."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_positive(field_name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{field_name}={value!r} must be {bound}")


def check_fields_positive(section: str, obj: object, names: Iterable[str]) -> None:
    """`check_positive` for each named field of a config section, reported as `section.name`."""
    for name in names:
        check_positive(f"{section}.{name}", getattr(obj, name))


@dataclass
class Endpoint:
    """A host and TCP port one role listens on (port 0: the local launcher picks a free one)."""

    host: str = "127.0.0.1"
    port: int = 0

    def check(self, key: str) -> None:
        """Validate as config key `key` (e.g. `spec.verifier`), naming it in the error."""
        if not self.host:
            raise ValueError(f"{key}.host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{key}.port={self.port} must be in 0..65535")


OLD_KEYS_UNTIL = "0.3"
"""The version that stops reading an endpoint's old key (`cluster.coordinator`, now
`fed.coordinator`): a test fails once `lab.__version__` reaches it with the old keys still read."""


OLD_DEFAULT_HOST = "127.0.0.1"
"""Where an old endpoint key's host defaulted (loopback): an old key that sets only a port keeps
it, rather than taking the new default `${cluster.master.host}`, which may be a LAN address."""


@dataclass
class OldEndpoint:
    """An endpoint's old key (`cluster.coordinator`, before it moved to `fed.coordinator`),
    which a command line or a cluster file may still set until version OLD_KEYS_UNTIL: what it
    sets goes to the key now, in one warning line naming it (`to_settings`)."""

    host: str | None = None
    port: int | None = None


_renamed: dict[str, str] = {}
"""The registered experiments' endpoints' old keys -> their keys now (`register_schema`)."""
_warned: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
"""The old keys this process has warned about (once each)."""


def old_keys() -> dict[str, str]:
    """The endpoints' old keys still read (old dotted key -> its key now)."""
    return dict(_renamed)


@dataclass
class LinkConfig:
    """Emulated network link between roles (netproto's link emulator); 0 means 'as is'."""

    delay_ms: float = 0.0
    """One-way delay added to every byte, in milliseconds."""
    bandwidth_mbps: float = 0.0
    """Bandwidth cap in megabits per second; 0 = unlimited."""

    def __post_init__(self) -> None:
        check_positive("cluster.link.delay_ms", self.delay_ms, allow_zero=True)
        check_positive("cluster.link.bandwidth_mbps", self.bandwidth_mbps, allow_zero=True)


@dataclass
class TLSConfig:
    """Optional TLS for netproto connections (standard `ssl` module)."""

    enabled: bool = False
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    """CA bundle that signed the peer's certificate; clients verify the server against it."""

    def __post_init__(self) -> None:
        if self.enabled and not (self.cert and self.key) and not self.ca:
            raise ValueError(
                "cluster.tls.enabled=true needs cluster.tls.cert and .key (server) "
                "or cluster.tls.ca (client)"
            )


@dataclass
class OverlayConfig:
    """The authenticated, encrypted overlay a split run across hosts listens in (TensorPipe, Gloo
    and the rendezvous store reach C++ paths that read and write the host's files: nobody outside
    the run may reach their ports). Loopback runs need none."""

    up: bool = False
    """The run brings up the lab's WireGuard overlay itself (root; wireguard-tools, nftables and
    the kernel's WireGuard or wireguard-go): the driver's host is its hub, keys are set up over
    netproto with the shared secret, and it is torn down when the run ends."""
    interface: str = ""
    """An overlay already up on this host (`python -m world.overlay up`, or your own
    WireGuard or Tailscale interface): the run listens on it only, and cluster.master.host must
    be the driver's address on it."""
    port: int = 0
    """The overlay hub's control port (TCP) on cluster.master.host; 0: cluster.master.port + 1."""
    subnet: str = "10.213.128.0/24"
    """The lab's overlay addresses: the driver .1, the stages .2, .3, ..."""

    def __post_init__(self) -> None:
        import ipaddress

        if not 0 <= self.port <= 65535:
            raise ValueError(f"cluster.overlay.port={self.port} must be in 0..65535")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:
            raise ValueError(f"cluster.overlay.subnet={self.subnet!r} is not a network") from None
        if net.version != 4 or net.prefixlen > 28:
            raise ValueError(f"cluster.overlay.subnet={self.subnet!r}: an IPv4 /28 or larger")
        if self.up and self.interface:
            raise ValueError("set one of cluster.overlay.up and cluster.overlay.interface")


@dataclass
class ClusterConfig:
    """What every role of every experiment shares: the rendezvous host, the secret, the
    timeouts, TLS, the overlay. An experiment's own servers listen at endpoints in its own
    section (`fed.coordinator`, `spec.verifier`), their host by default `cluster.master.host`."""

    name: str = "local"
    master: Endpoint = field(default_factory=Endpoint)
    """torch.distributed's rendezvous: the split runs' RPC world (their driver, rank 0), and
    data_parallel's c10d rendezvous of its elastic agents. Its host is also where each
    experiment's server listens unless told otherwise (`fed.coordinator.host`, ...): a cluster
    file names the serving host once."""
    secret: str | None = None
    """Shared secret for HMAC authentication; else `secret_file`, else the LAB_SECRET environment
    variable. Prefer those two: a value given here shows in `ps` while the command runs (every
    file the lab writes shows `***` instead)."""
    secret_file: str | None = None
    """A file holding the shared secret (keep it mode 0600), read at start: the secret kept off
    the command line and out of the environment."""
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_frame_mib: int = 256
    """Largest netproto frame accepted, checked before allocating (raise for big adapters)."""
    min_frame_rate_kbps: float = 1000.0
    """A netproto frame, once begun, must keep arriving at least this fast (kbit/s, after a
    10 s grace), or its connection is closed: a peer dribbling bytes cannot hold a slot. 1 Mbit/s
    is a tenth of the slowest link the harness emulates; lower it for a slower link, 0: off."""
    max_connections_per_address: int = 64
    """netproto sessions one remote address (an IPv6 /64) may hold at once on a server, of its
    256: one host cannot take every slot, secret or not."""
    link: LinkConfig = field(default_factory=LinkConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    overlay: OverlayConfig = field(default_factory=OverlayConfig)
    unsafe_plain_network: bool = False
    """Let a split run listen on a plain (non-overlay, non-loopback) network: anyone who reaches
    its ports can read and write files on its hosts. Only on a network you fully trust."""

    def __post_init__(self) -> None:
        self.master.check("cluster.master")
        check_positive("cluster.connect_timeout_s", self.connect_timeout_s)
        check_positive("cluster.read_timeout_s", self.read_timeout_s)
        check_positive("cluster.max_frame_mib", self.max_frame_mib)
        if self.secret_file:
            if self.secret:
                raise ValueError("set one of cluster.secret and cluster.secret_file, not both")
            read_secret_file(self.secret_file)  # a missing or empty file fails at start-up
        if not 0 <= self.min_frame_rate_kbps < float("inf"):
            raise ValueError(
                f"cluster.min_frame_rate_kbps={self.min_frame_rate_kbps!r} must be finite and >= 0"
            )
        check_positive("cluster.max_connections_per_address", self.max_connections_per_address)

    def open_to_the_network(self, hosts: Mapping[str, str]) -> list[str]:
        """Of `hosts` (each endpoint's dotted key -> its host), the `<key>.host=...` settings
        that are not loopback, when no secret is set: whoever reaches them joins the run (empty
        with a secret)."""
        if self.resolved_secret() is not None:
            return []
        return [f"{key}.host={host}" for key, host in hosts.items() if not is_loopback(host)]

    def resolved_secret(self) -> bytes | None:
        """The shared secret from `secret`, else `secret_file`, else $LAB_SECRET, else None (no
        auth). `secret=***` (what a redacted record says) needs it in $LAB_SECRET."""
        if self.secret and self.secret != REDACTED:
            return self.secret.encode()
        if self.secret_file:
            return read_secret_file(self.secret_file)
        secret = os.environ.get(SECRET_ENV)
        if secret:
            return secret.encode()
        if self.secret == REDACTED:
            from lab.cli import ConfigError

            raise ConfigError(
                f"cluster.secret={REDACTED} stands for a secret kept out of the records: give it "
                f"in {SECRET_ENV} or cluster.secret_file"
            )
        return None


@functools.cache
def read_secret_file(path: str) -> bytes:
    """The secret in file `path` (its text without surrounding whitespace); warns, once, when
    other users may read the file."""
    from lab.cli import ConfigError

    file = Path(os.path.expanduser(path))
    try:
        secret = file.read_text().strip()
        mode = file.stat().st_mode & 0o777
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cluster.secret_file={path}: cannot read it ({why})") from None
    if not secret:
        raise ConfigError(f"cluster.secret_file={path} is empty: write the shared secret in it")
    if mode & 0o077:
        log.warning(
            "cluster.secret_file=%s may be read by other users (mode %o): chmod 600 it", path, mode
        )
    return secret.encode()


MODEL_DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "4bit")


@dataclass
class ModelConfig:
    """A Hugging Face causal LM: by hub id, by local folder, or one of the lab's tiny models."""

    name: str = "tiny_target"
    pretrained: str = "lab:tiny_target"
    """Hub id (`TinyLlama/TinyLlama-1.1B-Chat-v1.0`), a local folder, or `lab:tiny_target` /
    `lab:tiny_draft` (trained offline by `python -m lab.pretrain`, on first use if missing)."""
    revision: str | None = None
    dtype: str = "auto"
    """auto picks per device: bfloat16 on CUDA that has it, float16 on other CUDA and MPS,
    float32 on CPU."""
    quantization: str = "none"
    """4bit loads the weights with bitsandbytes NF4 where this machine supports it."""
    trust_remote_code: bool = False
    lab_preset: str = "default"
    """Pretraining preset (`conf/pretrain/<preset>.yaml`) used for `lab:` models."""

    def __post_init__(self) -> None:
        if not self.pretrained:
            raise ValueError("model.pretrained must name a hub id, a folder or lab:<name>")
        check_choice("model.dtype", self.dtype, MODEL_DTYPES)
        check_choice("model.quantization", self.quantization, QUANTIZATIONS)


@dataclass
class LoRASettings:
    """PEFT LoRA adapters (fed_learn's clients, split_training's LoRA-only mode)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Every linear layer of a Llama block: on the lab's tiny models adapting q/v only barely
    moves the validation loss."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"lora.r={self.r} must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module")


WANDB_MODES = ("auto", "offline", "online")


@dataclass
class TrackingConfig:
    """Where metrics go: always `metrics.jsonl` in the run directory, plus W&B and the console."""

    wandb: bool = True
    wandb_mode: str = "auto"
    """auto: online when W&B is configured on this machine (API key or WANDB_MODE=online),
    offline otherwise."""
    project: str = "distributed-llm-lab"
    entity: str | None = None
    console: bool = True
    """Print a table of the final metrics."""

    def __post_init__(self) -> None:
        check_choice("tracking.wandb_mode", self.wandb_mode, WANDB_MODES)


DEFAULT_CACHE_DIR = "~/.cache/distributed-llm-lab"
CACHE_ENV = "LAB_CACHE"


def default_cache_dir() -> Path:
    """Where built artifacts live when `paths.cache_dir` is empty: $LAB_CACHE, else
    ~/.cache/distributed-llm-lab."""
    return Path(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR))


@dataclass
class PathsConfig:
    run_dir: str = "outputs/run"
    """This run's directory (Hydra's output dir): metrics, plots, checkpoints."""
    cache_dir: str = ""
    """Built artifacts shared between runs (the tiny models); empty: $LAB_CACHE, else
    ~/.cache/distributed-llm-lab."""

    @property
    def cache_path(self) -> Path:
        if not self.cache_dir:
            return default_cache_dir()
        return Path(os.path.expanduser(self.cache_dir))

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)


@dataclass
class LabConfig:
    """The base of every run's config (`conf/config.yaml`)."""

    seed: int = 0
    role: str = "local"
    """local starts every role on loopback; the others name one part of a multi-host run (each
    experiment lists its roles in its `lab.experiment.Experiment`)."""
    num_threads: int = 0
    """torch intra-op threads for this process; 0 = torch's default (all cores). Local runs
    give each of their processes its share of the cores, as if each had its own machine."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        check_positive("num_threads", self.num_threads, allow_zero=True)


SettingsT = TypeVar("SettingsT")


def to_settings(cfg: DictConfig | Any, schema: type[SettingsT]) -> SettingsT:
    """Resolve a composed config into its schema's dataclasses, running every validation.

    Raises ConfigError (a ValueError) naming the offending key (OmegaConf's own errors already
    name it).
    """
    from lab.cli import ConfigError

    if isinstance(cfg, schema):
        return cfg
    try:
        settings = OmegaConf.to_object(_moved_to_new_keys(cfg))
    except ValueError as exc:  # the schema's checks, and OmegaConf's type and value errors
        raise ConfigError(str(exc).strip()) from exc
    if not isinstance(settings, schema):
        raise TypeError(
            f"config is a {type(settings).__name__}, expected {schema.__name__}; "
            f"its YAML must list `{schema.__name__}`'s schema first in `defaults`"
        )
    return settings


def _moved_to_new_keys(cfg: Any) -> Any:
    """`cfg` with what an endpoint's old key sets moved to its key now, saying so in one
    warning line (once a process per old key); the new key set on the command line wins.
    Another experiment's old key (a cluster file written for every experiment) is dropped: a
    command line that sets it is refused (lab.experiment.refuse_unread)."""
    if not isinstance(cfg, DictConfig):
        return cfg
    given: dict[str, dict[str, Any]] = {}
    for old in _renamed:
        node = OmegaConf.select(cfg, old)
        if isinstance(node, DictConfig):
            given[old] = {str(k): v for k, v in node.items() if v is not None}
    if not given:
        return cfg
    typed = _command_line_keys()

    def typed_over(new: str, name: str) -> bool:  # the command line set it, or a section above
        return any(t in (new, f"{new}.{name}") or new.startswith(f"{t}.") for t in typed)

    given = {
        old: {k: v for k, v in values.items() if not typed_over(_renamed[old], k)}
        for old, values in given.items()
    }
    for old, values in given.items():  # an old key that named no host meant the old default
        if values and "host" not in values and not typed_over(_renamed[old], "host"):
            values["host"] = OLD_DEFAULT_HOST
    cfg = copy.deepcopy(cfg)
    for old, values in given.items():
        section = OmegaConf.select(cfg, old.rpartition(".")[0])
        with read_write(section), open_dict(section):
            del section[old.rpartition(".")[2]]
        new = _renamed[old]
        if not values or OmegaConf.select(cfg, new) is None:
            continue  # unset, or not an endpoint of this experiment
        for name, value in values.items():
            OmegaConf.update(cfg, f"{new}.{name}", value)
        said = (old, tuple(sorted((k, str(v)) for k, v in values.items())))
        if said not in _warned:  # once a process per old key and what it set
            _warned.add(said)
            read = ", ".join(f"{new}.{name}={value}" for name, value in values.items())
            log.warning(
                "%s is %s now: read as %s (the old key is read until version %s)",
                old,
                new,
                read,
                OLD_KEYS_UNTIL,
            )
    return cfg


def _command_line_keys() -> set[str]:
    """The keys this process's command line sets (none when Hydra is not running it)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    return {o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task}


def register_schema(
    name: str, node: type, *, group: str | None = None, renamed: Mapping[str, str] | None = None
) -> None:
    """Register a dataclass as the schema a YAML file lists in its `defaults`. `renamed`:
    endpoints' old keys (old dotted key -> its key now), each given a slot (`OldEndpoint`)
    where a command line or a cluster file may still set it, moved by `to_settings`."""
    stored: Any = node
    if renamed:
        _renamed.update(renamed)
        stored = OmegaConf.structured(node)
        for old in renamed:
            parent, _, leaf = old.rpartition(".")
            section = OmegaConf.select(stored, parent) if parent else stored
            if isinstance(section, DictConfig):
                with open_dict(section):
                    section[leaf] = OmegaConf.structured(OldEndpoint)
    ConfigStore.instance().store(name=name, node=stored, group=group)


register_schema("lab_schema", LabConfig)
