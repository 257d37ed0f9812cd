"""The files a run writes its records to, and their reader: what the tracker writes and the
plots, the report and the harness read (a floor below all of them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
OUTPUTS_FILE = "outputs.jsonl"
"""What a generating run produced: one JSON object per prompt (its new token ids and text)."""


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records a Tracker wrote to `path` (its metrics.jsonl or outputs.jsonl), in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]
