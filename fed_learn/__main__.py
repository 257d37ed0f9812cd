"""`python -m fed_learn [role=coordinator|client] [fed.strategy=ffa] [fed.rounds=5]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import fed_learn.config  # noqa: F401  (registers the schema)
from fed_learn.run import EXPERIMENT
from lab import commandline, experiment


@hydra.main(version_base="1.3", config_path="../conf", config_name="fed_learn")
def main(cfg: DictConfig) -> dict[str, float]:
    return experiment.main(EXPERIMENT, cfg)


if __name__ == "__main__":
    commandline.check_or_exit(EXPERIMENT)  # a mistaken override: one line, exit 2
    main()
