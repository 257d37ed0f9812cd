"""fed_learn's files split by job, not packed under a line limit: each at most 600 lines as
ruff lays it out with every `# fmt: skip` removed (issue 56; tests/test_floors.py keeps the
project's 800)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


@pytest.mark.parametrize("path", sorted((ROOT / "fed_learn").glob("*.py")), ids=lambda p: p.name)
def test_a_fed_learn_file_fits_600_lines_without_fmt_skip(path: Path) -> None:
    source = re.sub(r"[ \t]*# fmt: skip\b", "", path.read_text())
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", path.name, "-"],
        input=source,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    lines = len(formatted.splitlines())
    assert lines <= MAX_LINES, f"{path.name}: {lines} lines laid out; split it along its jobs"
