"""`python -m tensor_parallel [role=rank tp.ranks=2 tp.rank=R cluster.master.host=ADDR ...]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import tensor_parallel.config  # noqa: F401  (registers the schema)
from lab import commandline, experiment
from tensor_parallel.run import EXPERIMENT


@hydra.main(version_base="1.3", config_path="../conf", config_name="tensor_parallel")
def main(cfg: DictConfig) -> dict[str, float]:
    return experiment.main(EXPERIMENT, cfg)


if __name__ == "__main__":
    commandline.check_or_exit(EXPERIMENT)  # a mistaken override: one line, exit 2
    main()
