"""split_inference's config schema (`conf/split_inference.yaml`).

Only the shared settings so far; the module's own section is added with the module itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.config import LabConfig, register_schema


@dataclass
class SplitInferenceRunConfig(LabConfig):
    """Schema of `conf/split_inference.yaml`."""


register_schema("split_inference_schema", SplitInferenceRunConfig)
