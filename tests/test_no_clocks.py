"""No test claims a speed: an assertion that a clock reading stays under a number fails on a
busy machine (docs/testing.md). The one clock a test reads is a hang guard (tests/clocks.py).
Nor does one compare two measured timings (their difference, their ratio, one against the
other: CI once saw a shaped round trip's median less a direct one's come to 77 ms of a link's
80, the runner's load), or hold a rate worked out from one (bytes per measured second) above a
number. A floor on one measured timing is allowed: a delay the code stamps and sleeps for.
Nor does a child process's whole run get a deadline picked on an idle machine
(`subprocess.run(..., timeout=120)`): a loaded box outruns it and the test fails a run that
was only slow; such a bound is the hang guard."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.clocks import HANG_GUARD_S

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


AGGREGATES = {"min", "max", "median", "median_low", "median_high", "mean", "fmean", "sum"}
"""What keeps a list of timings a timing (`statistics.median(times)`, `min(times)`)."""


class _Timings:
    """What each expression of one file holds, as far as clocks go: an instant (a clock
    reading, `deadline = time.monotonic() + 5`), a duration (two instants apart, or a name,
    list or function's return fed with one), a rate (something per duration: a throughput)
    or a relative (a difference or ratio of two durations)."""

    def __init__(self, tree: ast.AST) -> None:
        self.names: dict[str, str] = dict.fromkeys(ELAPSED, "duration")
        self.functions: dict[str, str] = {}
        while self._learn(tree):  # to a fixpoint: a name may be fed by one assigned later
            pass

    def _learn(self, tree: ast.AST) -> bool:
        before = (dict(self.names), dict(self.functions))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(target.elts, node.value.elts, strict=False))
                    for name, value in pairs:
                        if isinstance(name, ast.Name) and (kind := self.kind(value)):
                            self.names.setdefault(name.id, kind)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                held = node.func.value
                appended = node.func.attr == "append" and isinstance(held, ast.Name) and node.args
                if appended and isinstance(held, ast.Name) and (kind := self.kind(node.args[0])):
                    self.names.setdefault(held.id, kind)
            elif isinstance(node, ast.FunctionDef):
                for sub in ast.walk(node):
                    returned = sub.value if isinstance(sub, ast.Return) else None
                    if returned is not None and (kind := self.kind(returned)):
                        self.functions.setdefault(node.name, kind)
        return before != (self.names, self.functions)

    def kind(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Subscript):
            return self.kind(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = func.value if isinstance(func, ast.Attribute) else None
            if isinstance(owner, ast.Name) and owner.id == "time" and name in CLOCKS:
                return "instant"
            if name in AGGREGATES or name == "sorted":
                kinds = {self.kind(arg) for arg in node.args}
                return next((k for k in ("relative", "rate", "duration") if k in kinds), None)
            return self.functions.get(name or "")
        if isinstance(node, ast.BinOp):
            left, right = self.kind(node.left), self.kind(node.right)
            if "relative" in (left, right):
                return "relative"
            if isinstance(node.op, ast.Sub | ast.Div) and left == right == "duration":
                return "relative"
            if isinstance(node.op, ast.Sub) and left == right == "instant":
                return "duration"
            if isinstance(node.op, ast.Div) and right == "duration":
                return "rate"
            return left or right
        return None


def compared_timings(path: Path) -> list[str]:
    """Assertions comparing two measured timings, a difference or ratio of them, or holding a
    rate worked out from one above a number, in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    timings = _Timings(tree)
    found = []

    def compares_timings(op: ast.cmpop, left: ast.expr, right: ast.expr) -> bool:
        kinds = (timings.kind(left), timings.kind(right))
        above = (isinstance(op, ast.Gt | ast.GtE) and kinds[0] == "rate") or (
            isinstance(op, ast.Lt | ast.LtE) and kinds[1] == "rate"
        )
        return "relative" in kinds or kinds == ("duration", "duration") or above

    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and any(
            compares_timings(op, left, right)
            for compare in ast.walk(node.test)
            if isinstance(compare, ast.Compare)
            for op, left, right in zip(
                compare.ops,
                [compare.left, *compare.comparators][:-1],
                compare.comparators,
                strict=True,
            )
        ):
            found.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    return found


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


PROCESS_RUNS = {"run", "communicate", "check_output", "check_call", "call"}
"""subprocess's calls that wait for a child's whole run (`timeout=`: TimeoutExpired after it)."""


def short_process_bounds(path: Path) -> list[str]:
    """`subprocess.run(..., timeout=N)` or `proc.communicate(timeout=N)` with N a number under
    the hang guard, in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in PROCESS_RUNS:
            continue
        for keyword in node.keywords:
            value = keyword.value
            if (
                keyword.arg == "timeout"
                and _is_a_number(value)
                and eval(compile(ast.Expression(value), str(path), "eval")) < HANG_GUARD_S
            ):
                found.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    return found


def test_no_child_process_run_has_a_deadline_under_the_hang_guard() -> None:
    """CI on a loaded box (stop 63: 6 min of CPU over 46 min of wall) would fail a run that
    was slow, not wrong: a child's run is bounded by tests.clocks.HANG_GUARD_S."""
    found = [hit for path in sorted(TESTS.rglob("*.py")) for hit in short_process_bounds(path)]
    assert not found, f"child runs bounded under HANG_GUARD_S (use it): {found}"


def test_the_check_finds_a_short_process_bound() -> None:
    """So the test above cannot pass by finding nothing; the guard itself, and a timeout that
    is not a number, pass."""
    sample = TESTS / "test_zz_bounded_sample.py"
    try:
        sample.write_text(
            "import subprocess\n"
            "from tests.clocks import HANG_GUARD_S\n"
            "def test_x(proc, limit):\n"
            "    subprocess.run(['true'], timeout=120)\n"
            "    proc.communicate(timeout=2 * 60)\n"
            "    subprocess.run(['true'], timeout=HANG_GUARD_S)\n"
            "    subprocess.run(['true'], timeout=limit)\n"
            "    subprocess.run(['true'], timeout=600)\n"
        )
        assert [hit.rsplit(":", 1)[1] for hit in short_process_bounds(sample)] == ["4", "5"]
    finally:
        sample.unlink()


def test_no_test_asserts_that_a_clock_stays_under_a_number() -> None:
    found = [hit for path in sorted(TESTS.rglob("test_*.py")) for hit in timed_assertions(path)]
    assert not found, f"timed assertions (prove the path from what the run says): {found}"


def test_no_test_compares_two_measured_timings() -> None:
    found = [hit for path in sorted(TESTS.rglob("test_*.py")) for hit in compared_timings(path)]
    assert not found, f"timings compared (assert the floor the code guarantees): {found}"


def test_the_check_finds_timings_compared() -> None:
    """The assertion CI failed on, and its kin; a floor on one timing passes."""
    sample = TESTS / "test_zz_compared_sample.py"
    try:
        sample.write_text(
            "import statistics, time\n"
            "def round_trips():\n"
            "    times = []\n"
            "    started = time.perf_counter()\n"
            "    times.append(time.perf_counter() - started)\n"
            "    return times\n"
            "def test_x():\n"
            "    direct, shaped = round_trips(), round_trips()\n"
            "    assert statistics.median(shaped) - statistics.median(direct) >= 0.079\n"
            "    assert min(shaped) >= 0.080\n"
            "    speedup = statistics.median(direct) / statistics.median(shaped)\n"
            "    assert speedup > 2\n"
            "    assert max(direct) < min(shaped)\n"
            "    started = time.monotonic()\n"
            "    took = time.monotonic() - started\n"
            "    assert 1e6 / took > 50, 'bytes a second'\n"
            "    assert took >= 0.5\n"
        )
        assert [hit.rsplit(":", 1)[1] for hit in compared_timings(sample)] == [
            "9",
            "12",
            "13",
            "16",
        ]
    finally:
        sample.unlink()


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
