"""`python -m data_parallel [role=worker dp.nnodes=2 cluster.master.host=ADDR ...] [dp.*=...]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import data_parallel.config  # noqa: F401  (registers the schema)
from data_parallel.run import EXPERIMENT
from lab import commandline, experiment


@hydra.main(version_base="1.3", config_path="../conf", config_name="data_parallel")
def main(cfg: DictConfig) -> dict[str, float]:
    return experiment.main(EXPERIMENT, cfg)


if __name__ == "__main__":
    commandline.check_or_exit(EXPERIMENT)  # a mistaken override: one line, exit 2
    main()
