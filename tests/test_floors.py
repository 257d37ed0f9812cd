"""The floors of the house (docs/architecture.md), read from the source, every import counted
wherever it stands (a cycle hidden inside a function is still a cycle):

    netproto  ->  lab  ->  world  ->  split_engine  ->  experiments  ->  labtools

Each floor imports only floors below it; no experiment imports a sibling; no module cycle; no
file outside tests/ and bench/ over 800 lines, counted as `ruff format` lays it out with every
`# fmt: skip` / `fmt: off` directive deleted (a file kept short by packing lines is still long).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("netproto", "lab", "world", "split_engine", "<experiment>", "labtools")
"""Lowest first."""
MAX_LINES = 800


def experiments() -> set[str]:
    """The experiment packages: every top-level package with a manifest.py."""
    return {path.parent.name for path in ROOT.glob("*/manifest.py")}


def floor_of(package: str) -> int | None:
    if package in experiments():
        return FLOORS.index("<experiment>")
    return FLOORS.index(package) if package in FLOORS else None


def modules() -> dict[str, Path]:
    """Every module of the project's packages (not tests/ or bench/), by dotted name."""
    found = {}
    for package in [*(p for p in FLOORS if not p.startswith("<")), *experiments()]:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module a dotted import name lands in (`lab.registry.Manifest`: lab.registry)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The project modules `path` imports, wherever in the file the import stands."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name, known)
            if target is not None:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imports(path, known)) - {name} for name, path in known.items()}


EDGES = graph()


@pytest.mark.parametrize("module", sorted(EDGES))
def test_each_module_imports_only_floors_below_it(module: str) -> None:
    here = module.split(".")[0]
    level = floor_of(here)
    assert level is not None
    upward = sorted(
        target
        for target in EDGES[module]
        if target.split(".")[0] != here and ((floor_of(target.split(".")[0]) or 0) >= level)
    )
    assert not upward, f"{module} imports {upward}: a floor at or above its own"


def test_the_floors_are_what_the_architecture_says() -> None:
    assert experiments() >= {"fed_learn", "spec_decoding", "split_inference", "split_training"}
    # netproto is the ground: it knows nothing of models, configs, networks' policy or
    # experiments; where ranks meet (store, overlay, fence, the safety policy) is world's
    above = ("lab", "world", "split_engine", *experiments())
    assert all(not t.startswith(above) for m, ts in EDGES.items() if m.startswith("netproto")
               for t in ts)  # fmt: skip
    assert {"world.store", "world.overlay", "world.fence", "world.network"} <= set(EDGES)
    assert not any(
        m.startswith(("netproto.overlay", "lab.fence", "split_engine.store")) for m in EDGES
    )


def test_no_module_cycle() -> None:
    """Tarjan's strongly connected components over every import: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in EDGES.get(node, ()):
            if target not in EDGES:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(EDGES):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", sorted(m for m in EDGES if m.split(".")[0] == "lab"))
def test_lab_names_no_experiment_or_tool_in_an_import(module: str) -> None:
    names = experiments() | {"labtools", "split_engine", "world"}
    assert not {t.split(".")[0] for t in EDGES[module]} & names


def test_no_file_over_800_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


FORMAT_EXEMPT: set[str] = set()  # (fed_learn/coordinator.py joined the count with issue 56)
FMT_DIRECTIVE = re.compile(r"[ \t]*# fmt: (skip|off|on)\b[^\n]*")


def unpacked(text: str) -> str:
    """`text` with every `# fmt: skip` / `# fmt: off` / `# fmt: on` directive deleted."""
    return FMT_DIRECTIVE.sub("", text)


def test_no_file_over_800_lines_as_ruff_formats_it(tmp_path: Path) -> None:
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    copies = {}
    for path in modules().values():
        name = str(path.relative_to(ROOT))
        if name in FORMAT_EXEMPT:
            continue
        copies[name] = tmp_path / name
        copies[name].parent.mkdir(parents=True, exist_ok=True)
        copies[name].write_text(unpacked(path.read_text()))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)  # the project's line length
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", "."], cwd=tmp_path, check=True)
    long = {
        name: n
        for name, copy in copies.items()
        if (n := len(copy.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines once ruff formats them unpacked: {long}"


def test_unpacking_deletes_every_directive() -> None:
    packed = "x = [1,2]  # fmt: skip\n# fmt: off\ny = 3\n# fmt: on\n"
    assert "fmt" not in unpacked(packed)
    assert unpacked(packed).splitlines()[0] == "x = [1,2]"


def test_the_architecture_page_names_every_registered_experiment() -> None:
    from lab import registry

    page = (ROOT / "docs" / "architecture.md").read_text()
    line = re.search(r"The experiments there are \(.*?\):\s*(.*?)\.\n", page, re.S)
    assert line, "docs/architecture.md lost its line naming the experiments"
    named = {word.strip() for word in line[1].replace("\n", " ").split(",")}
    assert named == set(registry.manifests()) == experiments()


def test_the_graph_sees_function_level_imports(tmp_path: Path) -> None:
    """The reader counts an import inside a function as an import (else it hides cycles)."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from lab import registry\n    import labtools.hosts\n")
    known = {"lab.registry": source, "labtools.hosts": source}
    assert set(imports(source, known)) == {"lab.registry", "labtools.hosts"}
