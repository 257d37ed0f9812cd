"""split_training's config schema (`conf/split_training.yaml`).

Only the shared settings so far; the module's own section is added with the module itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.config import LabConfig, register_schema


@dataclass
class SplitTrainingRunConfig(LabConfig):
    """Schema of `conf/split_training.yaml`."""


register_schema("split_training_schema", SplitTrainingRunConfig)
