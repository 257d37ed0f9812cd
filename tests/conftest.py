"""Shared fixtures: real Hydra configs with tiny limits, a private model cache, offline W&B."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from lab import registry
from lab.config import CONF_DIR

# Never touch the user's model cache, W&B account or the hub from a test.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PRIMARY_CONFIGS = sorted(
    p.stem for p in CONF_DIR.glob("*.yaml") if p.stem not in ("config", "matrix")
)
"""Entry-point configs of runs (`conf/<name>.yaml`); `config.yaml` is the base they all include.
`matrix.yaml` is run_matrix's, a sweep of runs (tests/labtools/test_matrix.py)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda` tests need a CUDA GPU: elsewhere they are skipped, saying why."""
    import torch

    if torch.cuda.is_available():
        return
    built = torch.version.cuda
    why = f"torch built for CUDA {built}, no device found" if built else "a CPU build of torch"
    reason = (
        f"needs a CUDA GPU: torch.cuda.is_available() is False here ({why}); "
        "`make gpu-check` runs these where a GPU is"
    )
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def import_schemas() -> None:
    """Register every schema: each experiment's through its manifest, and the tools' own."""
    for manifest in registry.manifests().values():
        manifest.load_schema()
    importlib.import_module("lab.pretrain")
    importlib.import_module("labtools.matrix")


@pytest.fixture(scope="session")
def lab_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cache = tmp_path_factory.mktemp("lab_cache")
    previous = os.environ.get("LAB_CACHE")
    os.environ["LAB_CACHE"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("LAB_CACHE", None)
    else:
        os.environ["LAB_CACHE"] = previous


def compose_into(
    run_dir: Path, cache: Path, name: str, overrides: list[str] | tuple[str, ...] = ()
) -> DictConfig:
    """Compose `conf/<name>.yaml` as Hydra would, writing into run_dir, tiny models on debug."""
    import_schemas()
    models = ["model"] if name != "spec_decoding" else ["target", "draft"]  # what it reads
    base = [
        f"paths.run_dir={run_dir}",
        f"paths.cache_dir={cache}",
        *(f"{model}.lab_preset=debug" for model in models),
        "tracking.console=false",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=[*base, *overrides])


@pytest.fixture
def compose_config(tmp_path: Path, lab_cache: Path) -> Callable[..., DictConfig]:
    """`compose_into` tmp_path: a test's own run folder."""

    def _compose(name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
        return compose_into(tmp_path, lab_cache, name, overrides)

    return _compose


@pytest.fixture(scope="session")
def tiny_models(lab_cache: Path) -> Path:
    """The debug preset's tiny_target / tiny_draft, built once per session (seconds)."""
    from lab.pretrain import ensure_tiny_models, load_preset

    return ensure_tiny_models(load_preset("debug"), lab_cache)
