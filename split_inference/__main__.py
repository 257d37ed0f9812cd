"""`python -m split_inference [role=driver|stage split.rank=K] [split.num_stages=3] [model=...]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import split_inference.config  # noqa: F401  (registers the schema)
from lab import commandline, experiment
from split_inference.run import EXPERIMENT


@hydra.main(version_base="1.3", config_path="../conf", config_name="split_inference")
def main(cfg: DictConfig) -> dict[str, float]:
    return experiment.main(EXPERIMENT, cfg)


if __name__ == "__main__":
    commandline.check_or_exit(EXPERIMENT)  # a mistaken override: one line, exit 2
    main()
