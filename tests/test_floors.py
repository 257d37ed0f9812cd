"""The floors of the house (docs: ARCHITECTURE, the architecture issue): netproto is the ground
and imports nothing of the lab's; lab/ imports no experiment but the ones still listed here,
which only shrink. Read from the source, function-level imports included (a cycle hidden
inside a function is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ("fed_learn", "spec_decoding", "split_inference", "split_training")
LAB_STILL_IMPORTS: set[tuple[str, str]] = set()


def imported_packages(path: Path) -> set[str]:
    """Top-level packages `path` imports, wherever in the file the import stands."""
    packages = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            packages |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            packages.add(node.module.split(".")[0])
    return packages


@pytest.mark.parametrize("path", sorted((ROOT / "netproto").glob("*.py")), ids=lambda p: p.name)
def test_netproto_imports_nothing_of_the_lab(path: Path) -> None:
    assert imported_packages(path) & {"lab", *EXPERIMENTS} == set()


def test_lab_imports_no_experiment_beyond_those_still_listed() -> None:
    found = {
        (str(path.relative_to(ROOT)), package)
        for path in sorted((ROOT / "lab").glob("*.py"))
        for package in imported_packages(path) & set(EXPERIMENTS)
    }
    assert found <= LAB_STILL_IMPORTS, f"new upward imports: {sorted(found - LAB_STILL_IMPORTS)}"
    assert found == LAB_STILL_IMPORTS, f"gone, strike them: {sorted(LAB_STILL_IMPORTS - found)}"
