"""Every config file composes with its schema; a bad value stops the run naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from lab.config import CONF_DIR, ClusterConfig, LabConfig, to_settings
from lab.pretrain import PretrainRunConfig

from .conftest import PRIMARY_CONFIGS

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
        ("cluster.verifier.port=not_a_port", "cluster.verifier.port"),
        ("cluster.verifyer.port=1", "verifyer"),
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
        ("role=boss", "role='boss'"),
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
        timeout=120,
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
