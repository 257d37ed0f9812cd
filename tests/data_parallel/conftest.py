"""Runs of data_parallel on the debug model, each started once per session and shared by the
tests that compare them (a run is an agent process and its workers: about ten seconds)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from data_parallel.manifest import step_records
from data_parallel.run import EXPERIMENT
from lab import experiment, registry
from lab.config import CONF_DIR

registry.manifest("data_parallel").load_schema()  # what `compose_dp` composes over

SHORT = ("dp.steps=10", "dp.max_train_blocks=256", "dp.eval_blocks=4", "dp.checkpoint_every=5",
         "dp.baseline=false")  # fmt: skip
"""Ten steps of the debug model, a checkpoint at 5 and 10; its gradient norms are above
dp.grad_clip=1, so the exactness tests also see the gradients' scale, not only their
direction (AdamW alone hides a gradient scaled by a constant). The one-process baseline
(dp.baseline) is off but where a test asks for it."""

Run = Callable[..., Path]


def compose_dp(run_dir: Path, cache: Path, overrides: tuple[str, ...]):
    base = [f"paths.run_dir={run_dir}", f"paths.cache_dir={cache}", "model.lab_preset=debug",
            "tracking.console=false", "tracking.wandb=false"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="data_parallel", overrides=[*base, *overrides])


def settings_key(cfg: DictConfig) -> str:
    """Every setting of a composed run but where it writes: equal keys, equal runs."""
    return OmegaConf.to_yaml({k: v for k, v in cfg.items() if k != "paths"}, sort_keys=True)


@pytest.fixture(scope="session")
def dp_run(tmp_path_factory: pytest.TempPathFactory, lab_cache: Path, tiny_models: Path) -> Run:
    """`dp_run(*overrides)`: the run folder of a local run with SHORT and these overrides,
    run once per session for the settings they compose to (`dp.engine=ddp` said or left to
    its default is one run: the runs are deterministic); `fresh=True`: always a new run, in
    `run_dir` if given."""
    done: dict[str, Path] = {}

    def run(*overrides: str, fresh: bool = False, run_dir: Path | None = None) -> Path:
        overrides = (*SHORT, *overrides)
        key = settings_key(compose_dp(Path("run"), lab_cache, overrides))
        if key in done and not fresh:
            return done[key]
        folder = run_dir or tmp_path_factory.mktemp("dp_run")
        experiment.run(EXPERIMENT, compose_dp(folder, lab_cache, overrides))
        if not fresh:  # a fresh run may be a resume into a copied folder: not the plain run
            done[key] = folder
        return folder

    return run


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    """Each step's `key`, by step."""
    return {int(r["step"]): float(r[key]) for r in step_records(run_dir, key)}


def worst_relative(ours: dict[int, float], theirs: dict[int, float]) -> float:
    assert ours and set(ours) <= set(theirs), (sorted(ours), sorted(theirs))
    return max(abs(ours[s] - theirs[s]) / abs(theirs[s]) for s in ours)
