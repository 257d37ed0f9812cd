"""`python -m split_training [role=driver|stage split.rank=K] [split.microbatches=4]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import split_training.config  # noqa: F401  (registers the schema)
from split_training.run import run


@hydra.main(version_base="1.3", config_path="../conf", config_name="split_training")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
