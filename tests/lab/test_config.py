"""Every config file composes with its schema; a bad value stops the run naming the key."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lab.config import CONF_DIR, ClusterConfig, LabConfig, ModelConfig, PathsConfig, to_settings
from lab.pretrain import PretrainConfig, PretrainRunConfig, load_preset
from tests.clocks import HANG_GUARD_S
from tests.conftest import PRIMARY_CONFIGS, import_schemas

GROUP_OPTIONS = [
    (group.name, path.stem)
    for group in sorted(CONF_DIR.iterdir())
    if group.is_dir()
    for path in sorted(group.glob("*.yaml"))
]


def test_config_tree_has_the_documented_groups() -> None:
    assert {"cluster", "model", "pretrain"} <= {group for group, _ in GROUP_OPTIONS}
    assert {"fed_learn", "spec_decoding", "split_inference", "split_training", "pretrain"} <= set(
        PRIMARY_CONFIGS
    )


@pytest.mark.parametrize("name", PRIMARY_CONFIGS)
def test_every_entry_point_config_composes_into_its_schema(compose_config, name: str) -> None:
    settings = to_settings(compose_config(name), LabConfig)
    assert type(settings).__name__.endswith("RunConfig")
    assert settings.cluster.name == "local"
    assert settings.model.pretrained == "lab:tiny_target"


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_group_option_composes(compose_config, group: str, option: str) -> None:
    settings = to_settings(compose_config("pretrain", [f"{group}={option}"]), PretrainRunConfig)
    section = getattr(settings, group)
    assert getattr(section, "name", getattr(section, "preset", None)) == option


def test_hub_models_name_their_hub_ids(compose_config) -> None:
    llama = to_settings(compose_config("pretrain", ["model=llama3_8b"]), LabConfig).model
    tiny = to_settings(compose_config("pretrain", ["model=tinyllama"]), LabConfig).model
    assert llama.pretrained == "meta-llama/Meta-Llama-3-8B"
    assert tiny.pretrained == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cluster.master.port=not_a_port", "cluster.master.port"),
        ("cluster.mastr.port=1", "mastr"),
        ("tracking.wandb=maybe", "tracking.wandb"),
        ("pretrain.batch_size=1.5", "pretrain.batch_size"),
    ],
)
def test_wrong_type_or_unknown_key_fails_at_composition(
    compose_config, override: str, key: str
) -> None:
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as info:
        compose_config("pretrain", [override])
    message = str(info.value) + str(info.value.__cause__ or "")
    assert key in message


def test_unknown_key_in_a_yaml_file_fails_naming_it(tmp_path, lab_cache) -> None:
    import shutil

    from hydra import compose, initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "typo.yaml").write_text("name: typo\npretrained: gpt2\nquantisation: 4bit\n")
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(ConfigCompositionException) as info,
    ):
        compose(config_name="pretrain", overrides=["model=typo"])
    assert "quantisation" in str(info.value) + str(info.value.__cause__)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("model.quantization=8bit", "model.quantization='8bit' is not allowed; choose one of"),
        ("model.dtype=float64", "model.dtype='float64'"),
        ("cluster.master.port=70000", "cluster.master.port=70000 must be in 0..65535"),
        ("cluster.link.delay_ms=-5", "cluster.link.delay_ms=-5.0 must be >= 0"),
        ("pretrain.target.hidden_size=65", "hidden_size=65 must be a multiple"),
        ("tracking.wandb_mode=sometimes", "tracking.wandb_mode"),
    ],
)
def test_bad_value_fails_validation_naming_the_key(
    compose_config, override: str, needle: str
) -> None:
    cfg = compose_config("pretrain", [override])
    with pytest.raises(ValueError) as info:
        to_settings(cfg, PretrainRunConfig)
    assert needle in str(info.value)


def test_cli_rejects_a_bad_override_before_doing_work(tmp_path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab.pretrain",
            "model.quantization=3bit",
            f"hydra.run.dir={tmp_path}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode != 0
    assert "model.quantization='3bit' is not allowed" in result.stderr + result.stdout
    assert not (tmp_path / "cache").exists()  # failed before building anything


def test_secret_comes_from_config_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAB_SECRET", raising=False)
    assert ClusterConfig().resolved_secret() is None
    monkeypatch.setenv("LAB_SECRET", "from-env")
    assert ClusterConfig().resolved_secret() == b"from-env"
    assert ClusterConfig(secret="from-config").resolved_secret() == b"from-config"


@pytest.mark.parametrize(
    ("name", "override", "needle"),
    [
        ("fed_learn", "fed.rounds=0", "fed.rounds=0 must be > 0"),
        ("fed_learn", "fed.strategy=magic", "fed.strategy='magic' is not allowed; choose one of"),
        ("fed_learn", "fed.compression=zip", "fed.compression='zip' is not allowed"),
        ("spec_decoding", "spec.max_new_tokens=0", "spec.max_new_tokens=0 must be > 0"),
    ],
)
def test_experiment_sections_name_their_bad_keys(
    compose_config, name: str, override: str, needle: str
) -> None:
    with pytest.raises(ValueError) as info:
        to_settings(compose_config(name, [override]), LabConfig)
    assert needle in str(info.value)


# --- one source of truth for every default -------------------------------------------------
# The schema dataclasses hold every default; a YAML file holds only what differs from its
# schema. Otherwise which value wins depends on how the code is entered (Hydra, load_preset,
# or a dataclass built in Python), as it once did for the pretraining presets.

HYDRA_ONLY = {"paths.run_dir": "${hydra:runtime.output_dir}"}
"""The one key a YAML may set to what only Hydra knows; the schema cannot hold it."""

GROUP_SCHEMAS = {"cluster": ClusterConfig, "model": ModelConfig, "pretrain": PretrainConfig}


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(_leaves(value, f"{prefix}{key}." if isinstance(value, dict) else prefix + key))
    return flat


def _schema_of(path: Path) -> type:
    if path.parent != CONF_DIR:
        return GROUP_SCHEMAS[path.parent.name]
    if path.stem == "config":  # the base every entry point includes
        return LabConfig
    import_schemas()
    schema = OmegaConf.get_type(ConfigStore.instance().repo[f"{path.stem}_schema.yaml"].node)
    assert schema is not None
    return schema


def _compose_bare(name: str, overrides: list[str] | None = None, *, conf: Path = CONF_DIR) -> Any:
    """Compose as `python -m` would with no overrides; the Hydra-only key set aside."""
    import_schemas()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides or [])
    for key in HYDRA_ONLY:
        OmegaConf.update(cfg, key, OmegaConf.select(OmegaConf.structured(PathsConfig), "run_dir"))
    return OmegaConf.to_object(cfg)


def schema_drift(name: str, *, conf: Path = CONF_DIR) -> dict[str, tuple[Any, Any]]:
    """Every key where `conf/<name>.yaml` composed by Hydra differs from its schema's default:
    key -> (through Hydra, in the schema)."""
    settings = _compose_bare(name, conf=conf)
    composed, expected = _leaves(asdict(settings)), _leaves(asdict(type(settings)()))
    return {
        key: (value, expected.get(key))
        for key, value in composed.items()
        if value != expected.get(key)
    }


YAML_FILES = sorted(CONF_DIR.rglob("*.yaml"))


def test_yaml_files_found() -> None:
    assert len(YAML_FILES) >= 14  # 6 entry points + cluster, model and pretrain options


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_yaml_holds_only_what_differs_from_its_schema(path: Path) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
    assert isinstance(raw, dict)
    raw.pop("defaults", None)
    raw.pop("hydra", None)
    schema = OmegaConf.to_container(OmegaConf.structured(_schema_of(path)))
    defaults = _leaves(schema)
    restated = {
        key: value
        for key, value in _leaves(raw).items()
        if key in defaults and value == defaults[key] and key not in HYDRA_ONLY
    }
    assert not restated, (
        f"{path.relative_to(CONF_DIR)} restates its schema's defaults {restated}: delete them "
        "from the YAML (the schema dataclass is the one place a default lives)"
    )
    for key, value in _leaves(raw).items():
        if key in HYDRA_ONLY:
            assert value == HYDRA_ONLY[key]


@pytest.mark.parametrize("name", PRIMARY_CONFIGS)
def test_hydra_and_the_schema_agree_on_every_default(name: str) -> None:
    """`python -m <module>` with no overrides runs exactly the schema's defaults."""
    drift = schema_drift(name)
    assert not drift, f"conf/{name}.yaml and its schema disagree (yaml, schema): {drift}"


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "pretrain").glob("*.yaml")))
def test_a_preset_is_the_same_through_hydra_and_through_load_preset(preset: str) -> None:
    """Models are built from `load_preset` when a run asks for `lab:` models, and from Hydra by
    `python -m lab.pretrain`: both must train the same models (same cache folder)."""
    through_hydra = _compose_bare("pretrain", [f"pretrain={preset}"]).pretrain
    assert through_hydra == load_preset(preset)
    assert through_hydra.fingerprint() == load_preset(preset).fingerprint()


def test_drift_between_a_yaml_and_its_schema_is_caught(tmp_path: Path) -> None:
    """The check above reports a YAML that sets a default of its own (as default.yaml once
    did), naming the key with both values."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "pretrain" / "default.yaml").write_text("context_length: 256\n")
    assert schema_drift("pretrain", conf=conf) == {
        "pretrain.context_length": (256, PretrainConfig().context_length)
    }


SHARED_CLUSTER = {
    "name", "master", "secret", "secret_file", "connect_timeout_s", "read_timeout_s",
    "max_frame_mib", "min_frame_rate_kbps", "max_connections_per_address", "link", "tls",
    "overlay", "unsafe_plain_network",
}  # fmt: skip
"""What every role of every experiment shares: the rendezvous, the secret, the timeouts and
netproto's session limits, the link emulator, TLS, the overlay. An experiment's own endpoints
live in its own section (fed.coordinator, spec.verifier): tests/lab/test_endpoints.py."""


def test_the_cluster_section_holds_only_what_every_role_shares() -> None:
    assert {f.name for f in fields(ClusterConfig)} == SHARED_CLUSTER
