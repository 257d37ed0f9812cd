"""fed_learn's config schema (`conf/fed_learn.yaml`).

Only the shared settings so far; the module's own section is added with the module itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.config import LabConfig, register_schema


@dataclass
class FedLearnRunConfig(LabConfig):
    """Schema of `conf/fed_learn.yaml`."""


register_schema("fed_learn_schema", FedLearnRunConfig)
