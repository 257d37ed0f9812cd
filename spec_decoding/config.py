"""spec_decoding's config schema (`conf/spec_decoding.yaml`).

Only the shared settings so far; the module's own section is added with the module itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab.config import LabConfig, register_schema


@dataclass
class SpecDecodingRunConfig(LabConfig):
    """Schema of `conf/spec_decoding.yaml`."""


register_schema("spec_decoding_schema", SpecDecodingRunConfig)
