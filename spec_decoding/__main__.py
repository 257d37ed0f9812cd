"""`python -m spec_decoding [role=verifier|drafter] [spec.gamma=4] [model@target=...]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import spec_decoding.config  # noqa: F401  (registers the schema)
from lab import commandline, experiment
from spec_decoding.run import EXPERIMENT


@hydra.main(version_base="1.3", config_path="../conf", config_name="spec_decoding")
def main(cfg: DictConfig) -> dict[str, float]:
    return experiment.main(EXPERIMENT, cfg)


if __name__ == "__main__":
    commandline.check_or_exit(EXPERIMENT)  # a mistaken override: one line, exit 2
    main()
