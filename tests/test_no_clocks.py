"""No test claims a speed: an assertion that a clock reading stays under a number fails on a
busy machine (docs/testing.md). The one clock a test reads is a hang guard (tests/clocks.py)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
CLOCKS = {"monotonic", "perf_counter", "time"}
ELAPSED = {"elapsed", "waited", "took", "duration", "wall_s"}


def _reads_a_clock(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        func = sub.func if isinstance(sub, ast.Call) else None
        named = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
        if named and func.value.id == "time" and func.attr in CLOCKS:  # type: ignore[union-attr]
            return True
        if isinstance(sub, ast.Name) and sub.id in ELAPSED:
            return True
    return False


def _is_a_number(node: ast.AST) -> bool:
    """A literal or arithmetic on literals (`10 + 15`): a speed someone picked."""
    return all(
        isinstance(sub, ast.Constant | ast.BinOp | ast.operator | ast.UnaryOp | ast.unaryop)
        for sub in ast.walk(node)
    )


def timed_assertions(path: Path) -> list[str]:
    """`assert <clock reading> < <number>` (or `<=`, or a chain ending so) in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Assert):
            continue
        for compare in ast.walk(node.test):
            if not isinstance(compare, ast.Compare):
                continue
            operands = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, operands[:-1], operands[1:], strict=True):
                if (
                    isinstance(op, ast.Lt | ast.LtE)
                    and _reads_a_clock(left)
                    and _is_a_number(right)
                ):
                    found.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    return found


def test_no_test_asserts_that_a_clock_stays_under_a_number() -> None:
    found = [hit for path in sorted(TESTS.rglob("test_*.py")) for hit in timed_assertions(path)]
    assert not found, f"timed assertions (prove the path from what the run says): {found}"


def test_the_check_finds_a_timed_assertion(tmp_path: Path) -> None:
    """So the test above cannot pass by finding nothing."""
    sample = TESTS / "test_zz_timed_sample.py"
    try:
        sample.write_text(
            "import time\n"
            "def test_x():\n"
            "    started = time.monotonic()\n"
            "    assert time.monotonic() - started < 10\n"
            "    elapsed = 1.0\n"
            "    assert 0.1 < elapsed < 5\n"
            "    assert time.monotonic() - started < HANG_GUARD_S\n"
        )
        assert [hit.rsplit(":", 1)[1] for hit in timed_assertions(sample)] == ["4", "6"]
    finally:
        sample.unlink()
